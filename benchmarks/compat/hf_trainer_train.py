"""A tiny BERT classifier (built from a config, nothing downloaded) trained with transformers.Trainer.

Launched by `torchrun --nproc-per-node 2` (or `gradsync run ...`): TrainingArguments reads the
launcher's environment, joins a Gloo group on CPU and wraps the model in DDP. Synthetic data: a
torch Dataset of dicts (input_ids, attention_mask, labels) whose label is whether most tokens are
below 54. 60 optimizer steps (batch 8 per rank, gradient accumulation 2), then an evaluation.
"""

import argparse
import os
import shutil
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, set_seed


class TokenTask(Dataset):
    def __init__(self, n: int, seed: int, length: int = 24) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(8, 100, (n, length), generator=gen)
        self.ids[:, 0] = 2  # [CLS]-like start token
        self.labels = ((self.ids[:, 1:] < 54).float().mean(1) > 0.5).long()  # most tokens are "low"

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def accuracy(pred) -> dict:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-steps", type=int, default=60)
    args = parser.parse_args()

    torch.set_num_threads(1)
    set_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(config)
    out = os.path.join(tempfile.gettempdir(), f"compat_hf_{os.environ.get('TORCHELASTIC_RUN_ID', 'solo')}")
    targs = TrainingArguments(
        output_dir=out, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=8,
        per_device_eval_batch_size=32, gradient_accumulation_steps=2, max_steps=args.max_steps,
        learning_rate=5e-3, warmup_steps=2, logging_steps=5, eval_strategy="no", save_strategy="no",
        report_to=[], dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=TokenTask(1024, 0), eval_dataset=TokenTask(250, 1),
                      compute_metrics=accuracy)
    train = trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"world size {targs.world_size}, parallel mode {targs.parallel_mode.value}, "
              f"model {type(trainer.model_wrapped).__name__}", flush=True)
        print(f"final: train loss {train.training_loss:.4f}, eval loss {metrics['eval_loss']:.4f}, "
              f"eval acc {metrics['eval_accuracy']:.4f}", flush=True)
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
