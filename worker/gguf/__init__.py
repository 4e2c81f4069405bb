"""GGUF files: the container (``file``), dequantization (``quants``), the tokenizer
(``tokenizer``), a llama-family checkpoint read from one (``checkpoint``), and ``sluice convert``
to a Hugging Face directory (``convert``)."""
