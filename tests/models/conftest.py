from __future__ import annotations

import torch

# The suite shares two cores with other work; tiny models gain nothing from threads.
torch.set_num_threads(1)
