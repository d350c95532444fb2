"""Data: tokenizers (bytes, Hugging Face, tiktoken), `distrain prepare`'s token files, corpus
reading, the train/val split, the named validation sets (data.eval_sets), the distributed,
resumable loader and the data-skew check."""

from distrain.data.corpus import DataError, read_corpus
from distrain.data.dataset import TokenDataset, build_datasets, build_eval_sets, split_tokens
from distrain.data.loader import DistributedBatchLoader, val_batches
from distrain.data.skew import check_data_skew, skew_message
from distrain.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "DistributedBatchLoader",
    "TokenDataset",
    "build_datasets",
    "build_eval_sets",
    "check_data_skew",
    "read_corpus",
    "skew_message",
    "split_tokens",
    "val_batches",
]
