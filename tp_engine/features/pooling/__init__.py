"""Pooling models (embedders, rerankers, classifiers): `params` (`PoolingParams`), `records`
(a pooled row per finished prompt, its result made on rank 0), `outputs` (their output
types), `llm` (`LLM.embed` / `classify` / `score`) and `rerank_prompt`."""
