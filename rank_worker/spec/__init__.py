"""Speculative decoding's draft heads: EAGLE-3's published layouts and refusals
(`eagle3_format`), the replicated one-layer head (`eagle3_head`), its cache and chain of drafts
(`eagle3_runner`) and the chain as CUDA graphs (`eagle3_graphs`)."""
