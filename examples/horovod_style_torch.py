"""A Horovod training script, unchanged but for its import line.

    mpiexec -n 2 python examples/horovod_style_torch.py [--epochs 2] [--checkpoint-dir DIR]

With Horovod the first import reads ``import horovod.torch as hvd``; everything below it is
Horovod's own idiom: init, lr scaled by size, broadcast of parameters and optimizer state from
rank 0, DistributedOptimizer, a DistributedSampler-style shard, metric averaging with allreduce and
a checkpoint written by rank 0 alone.
"""

import argparse
import os

import torch
import torch.nn.functional as F

import jupyter_ring.runtime.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="Horovod-style synthetic classification")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--checkpoint-dir", default="./checkpoints")
parser.add_argument("--fp16-allreduce", action="store_true")
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)

# A synthetic dataset; each rank reads its own shard, as DistributedSampler would give it.
generator = torch.Generator().manual_seed(0)
features = torch.randn(1024, 20, generator=generator)
labels = (features[:, :4].sum(dim=1) > 0).long()
dataset = torch.utils.data.TensorDataset(features, labels)
sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

# Horovod: scale the learning rate by the number of workers.
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)

resume_from_epoch = 0
checkpoint = os.path.join(args.checkpoint_dir, "checkpoint.pt")
if hvd.rank() == 0 and os.path.exists(checkpoint):
    state = torch.load(checkpoint)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    resume_from_epoch = state["epoch"] + 1
resume_from_epoch = hvd.broadcast_object(resume_from_epoch, root_rank=0, name="resume_from_epoch")

# Horovod: broadcast parameters & optimizer state from rank 0.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


for epoch in range(resume_from_epoch, resume_from_epoch + args.epochs):
    model.train()
    sampler.set_epoch(epoch)
    for batch, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    scheduler.step()

    model.eval()
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in loader)
    accuracy = metric_average(correct / len(sampler), "avg_accuracy")
    loss = metric_average(loss.item(), "avg_loss")
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {loss:.4f} accuracy {accuracy:.3f}", flush=True)
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                   checkpoint)

weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
same = hvd.allgather(weights.unsqueeze(0), name="final_weights")
assert all(torch.equal(same[0], row) for row in same), "ranks ended with different weights"
print(f"HOROVOD_STYLE_DONE {hvd.rank()} accuracy {accuracy:.3f}", flush=True)
