"""Where metrics go: metrics.jsonl / eval.jsonl in the run directory, a progress bar, wandb."""
from __future__ import annotations

import json
import pathlib
import sys
import time

import jax


class MetricsLogger:
    def __init__(self, workdir: pathlib.Path, config, start_step: int):
        self.main = jax.process_index() == 0
        self.workdir, self.first_step = workdir, start_step
        self.bar = self.run = None
        if not self.main:
            return
        self.total, self.started = config.train.steps, time.perf_counter()
        if sys.stdout.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, initial=start_step, unit="step",
                            dynamic_ncols=True, file=sys.stdout, mininterval=1.0)
        if config.wandb.mode != "disabled":
            import wandb
            self.run = wandb.init(project=config.wandb.project, entity=config.wandb.entity or None,
                                  mode=config.wandb.mode, dir=str(workdir), name=workdir.name,
                                  id=workdir.name.replace("/", "_"), resume="allow",
                                  config=config.to_dict())

    def _append(self, name: str, record: dict):
        with open(self.workdir / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def train(self, record: dict):
        if not self.main:
            return
        self._append("metrics.jsonl", record)
        if self.bar is not None:
            aux = {"aux": f"{record['aux_loss']:.4f}"} if "aux_loss" in record else {}
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", **aux,
                                 tok_s=f"{record['tokens_per_s']:.0f}",
                                 mfu=f"{100 * record['mfu']:.1f}%", refresh=False)
        else:  # a log file or a launcher's pipe: one plain line per logged step
            elapsed = time.perf_counter() - self.started
            step = record["step"]
            eta = elapsed / max(step - self.first_step, 1) * (self.total - step)
            # a mixture of experts' load-balancing loss and busiest expert (model/moe.py)
            moe = (f"aux {record['aux_loss']:.4f} load {record['expert_load']:.2f} "
                   if "aux_loss" in record else "")
            self.write(f"step {step}/{self.total} loss {record['loss']:.4f} {moe}"
                       f"tokens/s {record['tokens_per_s']:.0f} mfu {100 * record['mfu']:.1f}% "
                       f"eta {eta:.0f}s")
        if self.run is not None:
            self.run.log({f"train/{k}": v for k, v in record.items() if k != "step"},
                         step=record["step"])

    def eval(self, record: dict):
        if not self.main:
            return
        self._append("eval.jsonl", record)
        said = (f"(ppl {record['eval_ppl']:.1f})" if "eval_ppl" in record else
                ", ".join(f"{k.removeprefix('eval_').replace('_', ' ')} {v:.4g}"
                          for k, v in record.items() if k not in ("step", "eval_loss")))
        self.write(f"step {record['step']}: held-out loss {record['eval_loss']:.4f} {said}")
        if self.run is not None:
            self.run.log({f"eval/{k}": v for k, v in record.items() if k != "step"},
                         step=record["step"])

    def set_start(self, step: int):
        """A resumed run starts counting (progress, ETA) from its restored step."""
        self.first_step = step
        if self.bar is not None:
            self.bar.n = step

    def advance(self, n: int = 1):
        if self.bar is not None:
            self.bar.update(n)

    def write(self, msg: str):
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()
