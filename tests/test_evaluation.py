"""kNN and linear-probe evaluation against reference loops and scikit-learn; the `coretune eval` command."""

import hashlib
import json
import math
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import KNeighborsClassifier
from sklearn.preprocessing import StandardScaler

from coretune.apps.evaluation import extract_features, knn_predict, linear_probe, top_k_accuracy
from coretune.cli import _eval_parser, main


def _knn_loop(train: torch.Tensor, labels: torch.Tensor, test: torch.Tensor, k: int, tau: float, classes: int):
    """InstDisc's weighted kNN written out one test point at a time."""
    predictions = []
    for x in test.double():
        pairs = zip(train.double(), labels.tolist(), strict=True)
        sims = [(float(x @ t) / float(x.norm() * t.norm()), y) for t, y in pairs]
        sims.sort(key=lambda s: -s[0])
        votes = [0.0] * classes
        for s, y in sims[:k]:
            votes[y] += math.exp(s / tau)
        predictions.append(max(range(classes), key=lambda c: votes[c]))
    return predictions


def test_knn_equals_reference_loop() -> None:
    g = torch.Generator().manual_seed(0)
    train, test = torch.randn(60, 8, generator=g), torch.randn(25, 8, generator=g)
    labels = torch.randint(0, 4, (60,), generator=g)
    for k, tau in ((20, 0.07), (5, 0.5), (200, 0.1)):  # k beyond the bank size uses every training point
        expected = _knn_loop(train, labels, test, min(k, 60), tau, 4)
        assert knn_predict(train, labels, test, k=k, temperature=tau, num_classes=4, chunk_size=7).tolist() == expected


def test_knn_matches_sklearn_with_cosine_distance_and_exponential_weights() -> None:
    g = torch.Generator().manual_seed(1)
    train, test = torch.randn(300, 16, generator=g), torch.randn(100, 16, generator=g)
    labels = torch.randint(0, 5, (300,), generator=g)
    sk = KNeighborsClassifier(
        n_neighbors=20, metric="cosine", algorithm="brute", weights=lambda d: np.exp((1 - d) / 0.07)
    ).fit(train.numpy(), labels.numpy())
    ours = knn_predict(train, labels, test, k=20, temperature=0.07, num_classes=5)
    assert (ours.numpy() == sk.predict(test.numpy())).all()


def test_knn_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k must be >= 1 and temperature > 0, got k=0"):
        knn_predict(torch.randn(4, 2), torch.zeros(4, dtype=torch.long), torch.randn(2, 2), k=0)
    with pytest.raises(ValueError, match="5 training features but 4 labels"):
        knn_predict(torch.randn(5, 2), torch.zeros(4, dtype=torch.long), torch.randn(2, 2))


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    return x[:1200], y[:1200], x[1200:], y[1200:]


@pytest.mark.parametrize("c", [0.05, 1.0])
def test_linear_probe_matches_sklearn_logistic_regression(digits, c: float) -> None:
    x_train, y_train, x_test, y_test = digits
    probe = linear_probe(x_train, y_train, weight_decay=1 / (c * len(y_train)))  # λ = 1 / (C n)
    ours = probe(x_test).argmax(1).numpy()
    scaler = StandardScaler().fit(x_train.numpy())
    sk = LogisticRegression(C=c, max_iter=5000).fit(scaler.transform(x_train.numpy()), y_train.numpy())
    theirs = sk.predict(scaler.transform(x_test.numpy()))
    ours_acc, sk_acc = (ours == y_test.numpy()).mean(), (theirs == y_test.numpy()).mean()
    assert abs(ours_acc - sk_acc) <= 0.01 and ours_acc > 0.88
    assert (ours == theirs).mean() >= 0.98


def test_linear_probe_picks_the_weight_decay_on_a_holdout(digits) -> None:
    x_train, y_train, x_test, y_test = digits
    probe = linear_probe(x_train, y_train, weight_decay=[1e-4, 1e-2, 10.0])
    assert probe.weight_decay in (1e-4, 1e-2)  # λ = 10 flattens the classifier
    assert top_k_accuracy(probe(x_test), y_test, 1) > 0.88
    assert top_k_accuracy(probe(x_test), y_test, 10) == 1.0
    with pytest.raises(ValueError, match=r"weight_decay must be >= 0 \(a value or a non-empty grid\)"):
        linear_probe(x_train, y_train, weight_decay=[])


def test_a_probe_stopped_at_its_iteration_cap_says_so(digits) -> None:
    x_train, y_train, _, _ = digits
    capped = linear_probe(x_train, y_train, weight_decay=1e-6, max_iter=3)
    assert capped.iterations <= 3 and not capped.converged
    done = linear_probe(x_train, y_train, weight_decay=1e-2)
    assert done.converged and 0 < done.iterations < 500


def test_extract_features_uses_eval_mode_and_restores_it() -> None:
    encoder = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4), torch.nn.BatchNorm1d(4))
    encoder.train()
    x, y = torch.randn(10, 3, 2, 2), torch.arange(10)
    loader = [(x[:6], y[:6]), (x[6:], y[6:])]
    feats, labels = extract_features(encoder, loader)
    assert encoder.training
    encoder.eval()
    assert torch.allclose(feats, encoder(x).detach()) and labels.tolist() == list(range(10))


def _digit_folder(root: Path) -> Path:
    x, y = load_digits(return_X_y=True)
    for split, rows in (("train", range(0, 200)), ("test", range(200, 260))):
        for i in rows:
            folder = root / split / str(y[i])
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray((x[i].reshape(8, 8) * 255 / 16).astype(np.uint8)).save(folder / f"{i}.png")
    return root


def test_eval_command_scores_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from coretune.pretrain import SimCLR

    root = _digit_folder(tmp_path / "digits")
    weights = tmp_path / "simclr.pth.tar"
    torch.save(SimCLR(backbone="small_cnn").pretrained_checkpoint(), weights)
    common = ["--model.weights", str(weights), "--data.root", str(root), "--data.image_size", "8"]
    main(["eval", "knn", *common, "--output", str(tmp_path / "knn.json")])
    knn = json.loads((tmp_path / "knn.json").read_text())
    assert knn["backbone"] == "small_cnn" and knn["protocol"] == "knn"  # the backbone name comes from 'arch'
    assert knn["num_train"] == 200 and knn["num_test"] == 60 and knn["settings"] == {"k": 20, "temperature": 0.07}
    assert 0.5 < knn["top1"] <= 1.0  # random conv features of digits are far above chance (10%)
    main(["eval", "linear", *common, "--weight_decay", "[0.001]", "--output", str(tmp_path / "linear.json")])
    linear = json.loads((tmp_path / "linear.json").read_text())
    assert linear["settings"]["weight_decay"] == 0.001 and 0.5 < linear["top1"] <= linear["top5"]
    assert 0 < linear["settings"]["lbfgs_iterations"] < 500  # converged before the cap
    assert "knn small_cnn" in capsys.readouterr().out
    # the record names the very file scored (a path alone does not, once the checkpoint is re-made)
    assert knn["weights_sha256"] == linear["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert knn["seed"] == 0


def test_eval_of_a_random_initialisation_is_the_same_network_for_a_seed(tmp_path: Path) -> None:
    # the floor of a strength study: without --weights the backbone is random, and it was a new one on every call
    root = _digit_folder(tmp_path / "digits")
    common = ["--model.backbone", "small_cnn", "--data.root", str(root), "--data.image_size", "8", "--k", "1"]
    results = []
    for seed, name in ((0, "a"), (0, "b"), (1, "c")):
        torch.rand(7)  # whatever the caller drew before
        main(["eval", "knn", *common, "--seed", str(seed), "--output", str(tmp_path / f"{name}.json")])
        results.append(json.loads((tmp_path / f"{name}.json").read_text()))
    assert results[0] == results[1] and results[0]["weights"] is results[0]["weights_sha256"] is None
    assert results[2]["seed"] == 1 and results[2]["top1"] != results[0]["top1"]  # another network


def test_eval_without_images_to_score_says_so_before_extracting_features(tmp_path: Path) -> None:
    root = _digit_folder(tmp_path / "digits")
    shutil.rmtree(root / "test")  # train/ alone: the held-out validation part is no test split
    with pytest.raises(SystemExit, match=r"coretune eval: error: no images to score: .* or pass --data.test_dir$"):
        main(["eval", "knn", "--model.backbone", "small_cnn", "--data.root", str(root), "--data.val_fraction", "0.2"])


def test_eval_command_without_backbone_or_weights_explains(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"pass --model\.backbone"):
        main(["eval", "knn", "--data.root", str(tmp_path)])


def test_eval_refuses_a_test_split_that_reads_the_training_folder(tmp_path: Path) -> None:
    # every query would be in the kNN bank (its own nearest neighbour) and the probe's training set
    root = _digit_folder(tmp_path / "digits")
    for flag in ("--data.test_dir", "--data.val_dir"):
        shutil.rmtree(root / "test", ignore_errors=True)
        refused = r"coretune eval: error: coretune eval scores the test split, which reads the training folder here: "
        with pytest.raises(SystemExit, match=refused + r".* pass --data.test_dir \(or a val/ or test/ folder"):
            main(["eval", "knn", "--model.backbone", "small_cnn", "--data.root", str(root), flag, str(root / "train")])


def test_eval_refuses_test_images_that_are_training_files(tmp_path: Path) -> None:
    """A test class folder symlinked to its training folder passed the folder check (row 201)."""
    root = _digit_folder(tmp_path / "digits")
    shutil.rmtree(root / "test" / "3")
    (root / "test" / "3").symlink_to(root / "train" / "3", target_is_directory=True)
    shared = sorted((root / "test" / "3").iterdir())
    refused = (
        rf"coretune eval: error: {len(shared)} of the test split's images are training images too \(the same files, "
        rf"e\.g\. {re.escape(str(shared[0]))}\): .* \(a symlink into it counts\)$"
    )
    with pytest.raises(SystemExit, match=refused):
        main(["eval", "knn", "--model.backbone", "small_cnn", "--data.root", str(root), "--data.image_size", "8"])


def test_eval_warns_when_the_data_is_normalised_otherwise_than_the_weights_were_trained(tmp_path: Path) -> None:
    from coretune.pretrain import SimCLR

    root = _digit_folder(tmp_path / "digits")
    weights = tmp_path / "simclr.pth.tar"
    trained = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
    torch.save({**SimCLR(backbone="small_cnn").pretrained_checkpoint(), "normalization": trained}, weights)
    common = ["eval", "knn", "--model.weights", str(weights), "--data.root", str(root), "--data.image_size", "8"]
    with pytest.warns(UserWarning) as caught:
        main(common)
    assert (
        f"--model.weights {weights} were trained on images normalised with mean [0.5,0.5,0.5] and std "
        "[0.25,0.25,0.25], but the data is normalised with mean [0.485,0.456,0.406] and std [0.229,0.224,0.225]: "
        "pass --data.mean [0.5,0.5,0.5] --data.std [0.25,0.25,0.25] to feed the backbone inputs on the scale it learned"
    ) in [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main([*common, "--data.mean", "[0.5,0.5,0.5]", "--data.std", "[0.25,0.25,0.25]"])
    assert not [w for w in caught if "were trained on images normalised" in str(w.message)]


VIT = {"img_size": 32, "patch_size": 8, "depth": 2}  # a ViT-Tiny of two blocks on 32-px images: 4×4 patches of 8 px


def test_eval_builds_a_vit_with_the_backbone_args_it_was_pre_trained_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ViT pre-trained at 32 px with 8-px patches (MoCo v3's export) could not be scored: eval had no
    --model.backbone_args, and timm's default ViT-Tiny (16-px patches, 12 blocks) does not fit its weights."""
    from coretune.apps.evaluation import evaluate_encoder
    from coretune.data import ImageClassificationData
    from coretune.models import create_backbone
    from coretune.pretrain import MoCoV3

    root = _digit_folder(tmp_path / "digits")
    weights = tmp_path / "mocov3.pth.tar"
    torch.manual_seed(0)
    module = MoCoV3(backbone="vit_tiny_patch16_224", backbone_args=VIT, mlp_dim=16, proj_dim=8)
    torch.save(module.pretrained_checkpoint(), weights)  # facebookresearch/moco-v3's layout, 'arch' the timm name
    common = ["--model.weights", str(weights), "--data.root", str(root), "--data.image_size", "32", "--k", "5"]
    refused = r"8×8 patches but backbone 'vit_tiny_patch16_224' 16×16: .*--model\.backbone_args '\{patch_size: 8\}'"
    with pytest.raises(SystemExit, match=refused):
        main(["eval", "knn", *common])
    main(["eval", "knn", *common, "--model.backbone_args", json.dumps(VIT), "--output", str(tmp_path / "knn.json")])
    knn = json.loads((tmp_path / "knn.json").read_text())
    assert knn["backbone"] == "vit_tiny_patch16_224" and knn["backbone_args"] == VIT  # recorded with the score
    encoder = create_backbone("vit_tiny_patch16_224", weights=weights, verbose=False, **VIT)
    direct = evaluate_encoder(encoder, ImageClassificationData(root=str(root), image_size=32), "knn", k=5)
    assert knn["top1"] == direct.top1 and knn["settings"] == direct.settings  # the network built in Python
    dotted = [f"--model.backbone_args.{key}={value}" for key, value in VIT.items()]  # fit's other spelling
    assert _eval_parser().parse_args(["knn", *common, *dotted]).model.backbone_args == VIT
    with pytest.raises(SystemExit):
        main(["eval", "knn", *common, "--model.backbone_args", "[32]"])
    assert "--model.backbone_args: expected dict or null, got [32]" in capsys.readouterr().err


def test_eval_of_a_coretune_ckpt_builds_the_backbone_with_the_options_it_records(tmp_path: Path) -> None:
    """A .ckpt of coretune fit (or pretrain) records its backbone and backbone_args: both are the default."""
    from coretune.models import create_backbone

    root = _digit_folder(tmp_path / "digits")
    torch.manual_seed(0)
    body = create_backbone("vit_tiny_patch16_224", verbose=False, **VIT).body
    ckpt = tmp_path / "fit.ckpt"
    torch.save(
        {
            "pytorch-lightning_version": "2.5.0",
            "hyper_parameters": {"backbone": "vit_tiny_patch16_224", "backbone_args": VIT},
            "state_dict": {f"backbone.body.{key}": value for key, value in body.state_dict().items()},
        },
        ckpt,
    )
    common = ["eval", "knn", "--ckpt_path", str(ckpt), "--data.root", str(root), "--data.image_size", "32"]
    main([*common, "--output", str(tmp_path / "stored.json")])
    assert json.loads((tmp_path / "stored.json").read_text())["backbone_args"] == VIT
    # given options replace the recorded ones (here: without depth, the checkpoint lacks blocks 2-11)
    with pytest.raises(SystemExit, match=r"missing"):
        main([*common, "--model.backbone_args", "{img_size: 32, patch_size: 8}"])
