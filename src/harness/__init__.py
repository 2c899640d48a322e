"""dsocr-harness: a profiling-driven measurement harness for DeepSeek-OCR."""

__version__ = "0.1.0"
