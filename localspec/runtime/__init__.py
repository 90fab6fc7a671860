"""The runtime under the engine: a model runner that owns one sequence's KV cache (``runner``)
and the kernels and quantized layers it runs on (``quant``)."""
