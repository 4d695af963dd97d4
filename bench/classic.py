"""The classic PyTorch ImageNet example's training loop (pytorch/examples imagenet/main.py),
cut to what runs in one CPU process: the baseline ddptrain is measured against.

Kept as the example has it: torchvision's ImageFolder with its PIL loader, RandomResizedCrop +
flip, ToTensor, Normalize in the workers; fp32 in the contiguous layout; SGD with momentum 0.9
and weight decay 1e-4; a 1000-way head whatever the class count; loss.item() and top-1/top-5
accuracy every step. Workers are re-created every epoch, as there.

    python -m bench.classic DATA -a resnet18 -b 32 -j 2 --epochs 2 --lr 0.0125

prints a JSON line: samples/s of each epoch's training loop.
"""

import argparse
import json
import os
import time

import torch
import torchvision.models as models
from torch import nn
from torchvision import datasets, transforms

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [
            correct[:k].reshape(-1).float().sum(0, keepdim=True) * (100.0 / batch_size)
            for k in topk
        ]


def train(loader, model, criterion, optimizer) -> float:
    """One epoch as the example's train(); returns samples/s of the loop."""
    model.train()
    start, samples = time.perf_counter(), 0
    for images, target in loader:
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        loss.item(), acc1[0], acc5[0]  # the example's AverageMeter updates
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        samples += images.size(0)
    return samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("-a", "--arch", default="resnet18")
    parser.add_argument("-b", "--batch-size", type=int, default=256)
    parser.add_argument("-j", "--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    train_dataset = datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose(
            [
                transforms.RandomResizedCrop(args.image_size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(MEAN, STD),
            ]
        ),
    )
    loader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=torch.cuda.is_available(),
    )
    model = models.__dict__[args.arch]()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    rates = [train(loader, model, criterion, optimizer) for _ in range(args.epochs)]
    print(json.dumps({"samples_per_sec": rates, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
