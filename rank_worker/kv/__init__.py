"""This rank's K/V memory: the paged cache and its sizing (`cache`, reading the device through
`device_memory`), block copies between KV tiers (`copies`) and the side stream they run on
(`side_stream`)."""
