"""What a step's forward pass reads, built on the host: the block-table mirror (`block_tables`),
the staged inputs and their one host-to-device copy (`input_prep`, `copy_stream`), the CUDA-graph
batch sizes (`graph_sizes`) and the plans no scheduler made (`synthetic_plans`)."""
