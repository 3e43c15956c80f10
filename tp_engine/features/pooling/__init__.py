"""Pooling models (embedders, rerankers, classifiers): `rerank_prompt`, the Qwen3-Reranker card's
prompt (raw text is filled into it; text that already carries it is scored as it is). The rest
of pooling lives where its part of the path is: a request's `PoolingParams`
(`tp_engine.pooling_params`), the pooled rows' results on rank 0 (`tp_engine.core.pooled_records`),
the heads on the ranks (`rank_worker.models.heads`), `LLM.embed` / `classify` / `score` and their output
types (`tp_engine.frontend.llm_pooling`, `tp_engine.frontend.pooling_outputs`) and the routes
(`tp_engine.server.api.pooling_routes`)."""
