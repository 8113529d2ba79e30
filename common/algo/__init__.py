"""What a loss is made of: losses, advantages, log-probs, packing."""

# Torch-free constants of the log-prob kernel (common.algo.logprobs), read by the memory plan without torch.
# The workers' default on a GPU (ModelSpec.head_chunk_tokens). A training step's head holds a chunk's
# logits and their gradient at once: 2 x 2048 x 152k bf16 is 1.2 GiB (Qwen2.5), and the matmul stays large.
HEAD_CHUNK = 2048
# Model types whose logits are their head's output as it is, so the workers may make them in chunks
# (common.algo.logprobs.chunked_head): others scale or soft-cap them after the head (Gemma 2, Cohere).
PLAIN_HEAD = ("qwen2", "qwen3", "llama", "mistral")
