"""Weight sync, the formats both sides share: how the trainer's weights reach the rollout engine (step 7 of the RL
data path; docs/architecture.md, "Weight sync").

Every path carries Hugging Face names (tied embeddings once) in the engine's dtype, and never pickles:

- `buckets`: a weight version as a stream of safetensors byte strings (HTTP `/update_weights_from_tensor`);
- `mapped_file`: one safetensors file in /dev/shm that the trainer overwrites in place and the engine copies from
  (`/update_weights_from_disk`, same node);
- `distributed`: a `torch.distributed` group of its own, trainer rank 0 broadcasting tensor by tensor
  (`/update_weights_from_distributed`);
- `checksum`: the sha256 both sides report, compared after the version-0 sync.

The sending side is `miles_trainer/weight_sender.py`, the receiving side `miles_rollout/weight_receiver.py`, and
the transports that join them, one file each, `miles_orchestrator/cluster/transport/`.
"""
