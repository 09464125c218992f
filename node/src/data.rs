//! Token data: llm.c shards and per-worker batch streams (being written).
