"""This rank's K/V memory: the paged cache and its sizing (`cache`, reading the device through
`device_memory`), block copies between KV tiers (`copies`) and the side stream they run on
(`side_stream`), and pages to another server's ranks (prefill/decode disaggregation: the
transfer engine and block runs in `kv_transfer`, the rank's agent in `pd_agent`)."""
