"""DenseNet-121 and RegNetY-400MF in plain torch.nn, as torchvision 0.28 builds them
(torchvision's wheel here is a CUDA build that does not load beside the CPU torch).

Faithful to ``torchvision.models.densenet121`` and ``regnet_y_400mf``: the same layers in the
same order, the same initialization; ``depth_scale`` < 1 keeps the structure and cuts the
number of layers per block (for the suite)."""

from __future__ import annotations

import math

import torch
from torch import nn

# ---------------------------------------------------------------- DenseNet-121

class _DenseLayer(nn.Module):
    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, kernel_size=1, stride=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, kernel_size=3, stride=1, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        concated = torch.cat(features, 1)
        bottleneck = self.conv1(self.relu1(self.norm1(concated)))
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class _DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers: int, num_input_features: int, bn_size: int, growth_rate: int):
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1}",
                            _DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size))

    def forward(self, init_features: torch.Tensor) -> torch.Tensor:
        features = [init_features]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    def __init__(self, num_input_features: int, num_output_features: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, kernel_size=1, stride=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


class DenseNet(nn.Module):
    """torchvision's DenseNet (``memory_efficient=False``, ``drop_rate=0``)."""

    def __init__(self, growth_rate: int = 32, block_config=(6, 12, 24, 16), num_init_features: int = 64,
                 bn_size: int = 4, num_classes: int = 1000):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, num_init_features, kernel_size=7, stride=2, padding=3,
                                                    bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(num_init_features))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        num_features = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", _DenseBlock(num_layers, num_features, bn_size,
                                                                       growth_rate))
            num_features = num_features + num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", _Transition(num_features, num_features // 2))
                num_features = num_features // 2
        self.features.add_module("norm5", nn.BatchNorm2d(num_features))
        self.classifier = nn.Linear(num_features, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.relu(self.features(x), inplace=True)
        out = nn.functional.adaptive_avg_pool2d(out, (1, 1))
        return self.classifier(torch.flatten(out, 1))


def densenet121(num_classes: int = 1000, depth_scale: float = 1.0) -> DenseNet:
    blocks = tuple(max(1, round(n * depth_scale)) for n in (6, 12, 24, 16))
    return DenseNet(32, blocks, 64, 4, num_classes)


# ---------------------------------------------------------------- RegNetY-400MF

def _conv_bn(w_in: int, w_out: int, k: int, stride: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    """torchvision's Conv2dNormActivation: conv (no bias), BatchNorm, ReLU (optional)."""
    layers = [nn.Conv2d(w_in, w_out, k, stride, (k - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(w_out)]
    if relu:
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, input_channels: int, squeeze_channels: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class BottleneckTransform(nn.Sequential):
    def __init__(self, w_in: int, w_out: int, stride: int, group_width: int, se_ratio: float):
        w_b = w_out  # bottleneck multiplier 1.0
        super().__init__()
        self.add_module("a", _conv_bn(w_in, w_b, 1))
        self.add_module("b", _conv_bn(w_b, w_b, 3, stride, groups=w_b // group_width))
        self.add_module("se", SqueezeExcitation(w_b, int(round(se_ratio * w_in))))
        self.add_module("c", _conv_bn(w_b, w_out, 1, relu=False))


class ResBottleneckBlock(nn.Module):
    def __init__(self, w_in: int, w_out: int, stride: int, group_width: int, se_ratio: float):
        super().__init__()
        self.proj = _conv_bn(w_in, w_out, 1, stride, relu=False) if (w_in != w_out or stride != 1) else None
        self.f = BottleneckTransform(w_in, w_out, stride, group_width, se_ratio)
        self.activation = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x) + self.f(x) if self.proj is not None else x + self.f(x)
        return self.activation(x)


class RegNet(nn.Module):
    """torchvision's RegNet with SimpleStemIN and ResBottleneckBlock."""

    def __init__(self, depths, widths, group_width: int, se_ratio: float, num_classes: int = 1000,
                 stem_width: int = 32):
        super().__init__()
        self.stem = _conv_bn(3, stem_width, 3, 2)
        blocks, current = [], stem_width
        for i, (w_out, depth) in enumerate(zip(widths, depths)):
            stage = nn.Sequential()
            for j in range(depth):
                stage.add_module(f"block{i + 1}-{j}", ResBottleneckBlock(current if j == 0 else w_out, w_out,
                                                                         2 if j == 0 else 1, group_width, se_ratio))
            blocks.append((f"block{i + 1}", stage))
            current = w_out
        self.trunk_output = nn.Sequential()
        for name, stage in blocks:
            self.trunk_output.add_module(name, stage)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(current, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                nn.init.normal_(m.weight, mean=0.0, std=math.sqrt(2.0 / fan_out))
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.trunk_output(self.stem(x)))
        return self.fc(x.flatten(start_dim=1))


def regnet_y_400mf(num_classes: int = 1000, depth_scale: float = 1.0) -> RegNet:
    """``BlockParams.from_init_params(depth=16, w_0=48, w_a=27.89, w_m=2.09, group_width=8,
    se_ratio=0.25)``: stage depths (1, 3, 6, 6), widths (48, 104, 208, 440)."""
    depths = tuple(max(1, round(d * depth_scale)) for d in (1, 3, 6, 6))
    return RegNet(depths, (48, 104, 208, 440), 8, 0.25, num_classes)
