//! A model of one LLM inference engine (vLLM-like) in virtual time.
