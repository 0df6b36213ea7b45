"""torch.distributed: FSDP2 and tensor parallel with real processes, DCP checkpoints, Lightning's sharded folders."""
