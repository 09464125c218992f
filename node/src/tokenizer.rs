//! Tokenizers (being written).
