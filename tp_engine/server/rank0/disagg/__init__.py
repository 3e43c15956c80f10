"""Prefill/decode disaggregation on rank 0 (`--disaggregation-mode`), SGLang's protocol at the
HTTP edge so that `sglang-router --pd-disaggregation` drives it unchanged.

The router sends one request to a prefill server and a decode server at once, both carrying
`bootstrap_host` / `bootstrap_port` (the prefill's bootstrap server) and a random
`bootstrap_room` that pairs them:

    decode rank 0                          prefill rank 0                 prefill ranks
      GET /route (once per prefill) ─────► bootstrap server: its TP, page
      checks page size, dtype, TP  ◄─────    size, dtype, where to send
      takes the prompt's blocks,
      KVRequest(room, blocks, ranks) ────► pairs the room with its request;
                                           computes the prompt (one token)
                                           SendOrder per rank ────────────► writes its KV heads
                                                                            into decode rank r
                                           ◄──────────────────────────────── RankDone
                 KVStatus(first token) ◄── frees its blocks, answers its
      the request joins the batch           HTTP request with that token
      with its first token, computes
      no prompt

Pieces: `agents` (the ranks' KV agents report to rank 0), `bootstrap` (the prefill's bootstrap
HTTP server), `prefill` and `decode` (each role's rooms and timeouts), `loop_hooks` (what the
engine loop calls). The bytes move between the ranks (`rank_worker.kv.pd_agent`), never through
rank 0.
"""
