"""Data for fine-tuning: the image-classification LightningDataModule, its datasets, transforms and splits."""

from .classification import ImageClassificationData
from .datasets import ImageFileDataset, LabeledImageDataset, load_cifar
from .errors import DataError, ImageDecodeError
from .images import (
    IMAGE_EXTENSIONS,
    SkippedImagesWarning,
    find_bad_images,
    list_image_files,
    load_rgb,
    to_rgb,
)
from .splits import stratified_split, stratified_subset
from .transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transform, train_transform

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "DataError",
    "ImageClassificationData",
    "ImageDecodeError",
    "ImageFileDataset",
    "LabeledImageDataset",
    "SkippedImagesWarning",
    "eval_transform",
    "find_bad_images",
    "list_image_files",
    "load_cifar",
    "load_rgb",
    "stratified_split",
    "stratified_subset",
    "to_rgb",
    "train_transform",
]
