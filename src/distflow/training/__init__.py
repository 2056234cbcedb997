"""The trained models and what is done with them: loading (models, hf_weights), data parallelism
(parallelize), LoRA, the token layout (sequences), the forward passes (logprobs, packing,
prefix_sharing), the trainable policy, reference and critic (trainable, policy, critic), and the
trained-model registry that builds them on a rank (registry)."""
