"""One training job for test_dist_trainer.py, run under mpiexec (or alone):
python dist_trainer_job.py OUT_DIR DATA MODEL_JSON DIST GRAD_ACCUM UNTIL RESUME

(fit(until=N) stops a run part-way through its schedule, which the command line cannot.)"""

from __future__ import annotations

import sys

from blutrain.models.train_config import TrainConfig
from blutrain.models.trainer import Trainer

out, data, model, mode, accum, until, resume = sys.argv[1:8]
cfg = TrainConfig(
    model=model,
    data=data,
    batch_size=2,
    seq_len=16,
    grad_accum=int(accum),
    max_steps=4,
    lr=3e-3,
    warmup_steps=2,
    eval_interval=2,
    eval_batches=2,
    sample_interval=0,
    out_dir=out,
    progress=False,
    plot=False,
    log_interval=0,
    device="cpu",
    dist=mode,
    resume=resume == "1",
)
Trainer(cfg).fit(until=int(until) if int(until) else None)
