"""The reference engine: a seeded transformer, a paged KV pool, a prefix cache that emits KV
events, a continuous-batching scheduler and SGLang/OpenAI-compatible worker HTTP."""
