"""What a path is (a torch.save file, a converted file or shard set, a framework's checkpoint folder, a
DCP folder, a DeepSpeed checkpoint) and the verbs ``convert``, ``expand`` and ``info`` on each."""
