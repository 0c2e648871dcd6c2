"""The model core: what a model folder is and what is done to it. Loading (full, LoRA, QLoRA;
causal LM or reward model), merging an adapter, manifests and hashes, the embedded default model,
and where a reward is read. It knows nothing of training loops."""
