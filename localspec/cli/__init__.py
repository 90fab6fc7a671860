"""The command line: ``python -m localspec generate | bench | verify | presets | export-vllm``
(``main``), with the benchmark (``bench``), the lossless check (``check``) and the vLLM export
(``export``)."""
