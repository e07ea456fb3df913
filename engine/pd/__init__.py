"""Prefill/decode disaggregation: prefill and decode workers over the transfer/ data plane, their
rank processes under torch.distributed, and the per-room evidence a decode keeps."""
