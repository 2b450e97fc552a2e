"""megatron-rembert: pre-training RemBERT-style encoders with decoupled embeddings."""

__version__ = "0.2.0"
