"""The runtime under the engine: a model runner that owns one sequence's KV cache (``runner``),
the CPU forward (``decoder``, ``native``), the kernels and quantized layers it runs on
(``kernels``, ``quant``), and its weights: their formats (``weight_formats``) and how they are
read from a GGUF file (``gguf_header``, ``gguf_kquants``, ``gguf_pack``). Below ``models``,
which decides where weights are cached and which file a model name means."""
