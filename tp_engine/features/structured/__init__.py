"""Structured outputs: `grammar` compiles a request's constraint for the tokenizer (xgrammar, on
a background thread) and keeps each sequence's matcher; the core holds such requests in its
`GrammarGate` until compiled, and the sampler applies the matchers' token bitmasks."""
