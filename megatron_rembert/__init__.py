"""megatron-rembert: pre-training RemBERT-style encoders with decoupled embeddings."""

__version__ = "0.1.0"
