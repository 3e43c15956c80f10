"""Pooling models (embedders, rerankers, classifiers): `params` (`PoolingParams`), `records`
(a pooled row per finished prompt, its result made on rank 0) and `rerank_prompt`. What `LLM`
makes of them (`embed` / `classify` / `score` and their output types) is the front end's
(`tp_engine.frontend.llm_pooling`, `tp_engine.frontend.pooling_outputs`)."""
