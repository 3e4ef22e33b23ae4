"""Character-hash text classifier on 2 ranks: rank 0 builds the hashed vocabulary with a
small multithreaded C tokenizer compiled at start-up and shares it with the other rank,
then every rank tokenizes its shard of synthetic sentences in DataLoader worker processes
and trains a DDP-wrapped bag-of-embeddings classifier for two epochs."""
import ctypes
import datetime
import os
import subprocess
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

C_SRC = r"""
#include <pthread.h>
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_task = PTHREAD_COND_INITIALIZER;
static pthread_cond_t cv_done = PTHREAD_COND_INITIALIZER;
static int started = 0, pending = 0, done = 0;
static const char *task_s;
static long task_res;
static pthread_t worker_thread;

static void *worker(void *arg) {
    (void)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!pending) pthread_cond_wait(&cv_task, &mu);
        unsigned long h = 5381;
        for (const char *p = task_s; *p; p++) h = h * 33 + (unsigned char)*p;
        task_res = (long)(h % 1000003);
        pending = 0;
        done = 1;
        pthread_cond_signal(&cv_done);
    }
    return 0;
}

void tok_reset(void) {
    started = 0;
    pending = 0;
    done = 0;
    pthread_mutex_init(&mu, 0);
    pthread_cond_init(&cv_task, 0);
    pthread_cond_init(&cv_done, 0);
}

long tok_hash(const char *s) {
    pthread_mutex_lock(&mu);
    if (!started) {
        pthread_create(&worker_thread, 0, worker, 0);
        started = 1;
    }
    task_s = s;
    done = 0;
    pending = 1;
    pthread_cond_signal(&cv_task);
    while (!done) pthread_cond_wait(&cv_done, &mu);
    long r = task_res;
    pthread_mutex_unlock(&mu);
    return r;
}
"""
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "theta", "kappa", "lambda", "zeta"]
_LIB = None


def tokenizer():
    global _LIB
    if _LIB is None:
        d = tempfile.mkdtemp(prefix="tok_")
        with open(os.path.join(d, "tok.c"), "w") as f:
            f.write(C_SRC)
        so = os.path.join(d, "libtok.so")
        subprocess.check_call(["gcc", "-O2", "-shared", "-fPIC", "-pthread", "-o", so, os.path.join(d, "tok.c")])
        _LIB = ctypes.CDLL(so)
        _LIB.tok_hash.argtypes = [ctypes.c_char_p]
        _LIB.tok_hash.restype = ctypes.c_long
    return _LIB


def sentences(n=64):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, len(WORDS), (6,), generator=g).tolist()
        out.append((" ".join(WORDS[i] for i in idx), int(idx[0] % 2)))
    return out


class TextSet(Dataset):
    def __init__(self, rows, vocab):
        self.rows, self.vocab = rows, vocab

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        text, label = self.rows[i]
        lib = tokenizer()
        ids = [self.vocab[lib.tok_hash(w.encode())] for w in text.split()]
        return torch.tensor(ids), torch.tensor(label)


def reset_worker(_):
    tokenizer().tok_reset()


def build_vocab():
    lib = tokenizer()
    hashes = sorted({lib.tok_hash(w.encode()) for w in WORDS})
    return {h: i for i, h in enumerate(hashes)}


def train(rank, world):
    payload = [build_vocab() if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    vocab = payload[0]
    rows = sentences()[rank::world]
    loader = DataLoader(TextSet(rows, vocab), batch_size=8, num_workers=2, worker_init_fn=reset_worker)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.EmbeddingBag(len(vocab), 16), nn.Linear(16, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(2):
        for ids, y in loader:
            loss = nn.functional.cross_entropy(model(ids), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    train(rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
