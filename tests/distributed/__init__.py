"""Multi-process tests with real torch.distributed (gloo, CPU): FSDP2 data parallel and Ulysses SP."""
