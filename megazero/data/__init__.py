"""Data pipeline (L4): tokenizers, memory-mapped token files, fixed-length samples, dp-sharded micro-batches.

Typical use on each rank (only the pipeline stages that read data open the files):

    it = build_data_iterator("data/stdlib", seq_len=128, micro_batch_size=2,
                             gradient_accumulation_steps=4, dp_rank=d, dp_size=D, seed=1234,
                             start_step=0, needs_data=stage in (0, num_stages - 1))
    batch = next(it)   # {"input_ids": (2, 128) int64, "labels": (2, 128) int64}

Create the files with tools/preprocess_data.py (or `preprocess(demo_corpus(...), prefix)`).
"""
from .corpus import (PreprocessSummary, demo_corpus, file_documents, input_files, preprocess,
                     stdlib_files)
from .dataset import SampleOrder, TokenSampleDataset, epoch_permutation
from .indexed import DataPathError, IndexedTokens, IndexedWriter, InMemoryTokens, preprocess_hint
from .sampler import MicroBatchIterator, NoDataIterator, WorkerMicroBatches, build_data_iterator
from .tokenizer import (BYTE_VOCAB_SIZE, BPETokenizer, ByteTokenizer, check_vocab, load_tokenizer,
                        tokenizer_path)

__all__ = [
    "BYTE_VOCAB_SIZE", "BPETokenizer", "ByteTokenizer", "DataPathError", "IndexedTokens", "IndexedWriter",
    "InMemoryTokens", "MicroBatchIterator", "NoDataIterator", "PreprocessSummary", "SampleOrder",
    "TokenSampleDataset", "WorkerMicroBatches", "build_data_iterator", "check_vocab", "demo_corpus", "epoch_permutation",
    "file_documents", "input_files", "load_tokenizer", "preprocess", "preprocess_hint", "stdlib_files",
    "tokenizer_path",
]
