"""The modules the models are built from, beside the model math: linear layers whole or cut for tensor
parallelism (linear.py), the embedding table (embedding.py), MoE experts computed grouped by expert
(experts.py), and the poolers of embedding and reranker models (pooler.py)."""
