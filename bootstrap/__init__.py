"""The per-instance bootstrap directory: an SGLang-compatible rank table server, mirrored into etcd."""
