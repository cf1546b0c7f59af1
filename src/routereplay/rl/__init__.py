"""The embedded default: a synthetic task, a tiny MoE that learned it, GRPO with off / R2 / R3, the demo.

Files:
- `async_grpo.py`    Fully-async GRPO: the engine keeps sampling while the trainer trains; weight syncs abort
                     and resume
- `demo.py`          The main job: rollouts from the built-in engine, scored by the trainer with and without
                     R3
- `grpo.py`          A small, readable GRPO with router replay: off, R2 or R3
- `model.py`         The demo model: a tiny MoE that has learned digit addition, trained by the project and
                     cached
- `rollout_pool.py`  Samples in flight in fully-async GRPO: partial rollouts, their routes across resumes,
                     finished groups
- `scoring.py`       Trainer-side scoring of rollouts: one padded batch, the log-prob of every response token
- `tasks.py`         Digit addition: the synthetic task the demo model learns, its tokenizer and its reward
"""
