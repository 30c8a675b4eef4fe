"""Encode a folder of real images or video clips to latent records: ``python -m miles.rollout.encode_images``.

The records are the data format that ``--train-only`` reads (and the critic's real data of DMD2 phase 2): each
names a latent file that :func:`miles.rollout.data_source.load_record_latent` loads, so training never runs the VAE
encoder on its images. Any model family works; for ``sd3`` the latent is the pipeline's own VAE posterior mode with
its ``shift_factor`` and ``scaling_factor`` applied, ``(mode − shift) · scaling``, as in
:meth:`miles.models.sd3.SD3Family.images_to_latents`::

    python -m miles.rollout.encode_images PIPELINE IMAGE_DIR OUT_DIR [--captions captions.jsonl] [--prompt TEXT]
        [--batch-size 8]

reads every ``.png``, ``.jpg`` / ``.jpeg`` and ``.webp`` file directly in IMAGE_DIR (sorted by name), or for a video
family (``wan``) every ``.mp4``, ``.mkv``, ``.webm``, ``.mov``, ``.avi`` and ``.gif`` file, and writes::

    OUT_DIR/latents/<name>.safetensors   one tensor "latent", float32 (C, h, w), <name> = the image's file stem
    OUT_DIR/data.jsonl                    {"prompt": ..., "latent": "latents/<name>.safetensors", "file_name": ...}
    OUT_DIR/encode_images.json            pipeline, family, image and latent shapes, count

An image's caption is, in this order: its line in ``--captions`` (JSONL ``{"file_name": "cat.png", "prompt": "a
cat"}``), its sidecar ``<name>.txt`` beside the image (stripped), or ``--prompt``. A captions line's other keys are
copied into its image's record unchanged: an edit family's reference, ``{"file_name": "after.png", "prompt": "make it
blue", "condition_image": "/data/before/cat.png"}``, which ``python -m miles.rollout.prompt_cache OUT_DIR/data.jsonl``
then encodes with the prompt (a relative path is read relative to OUT_DIR, so give absolute ones).

Each image is turned upright by its EXIF orientation, converted to the pipeline's channels (RGB for SD3), resized
with Lanczos so that it covers the pipeline's pixel size (``family.image_shape``: for SD3 the transformer's
``sample_size`` times the VAE's downscale factor, 1024 × 1024 for SD3.5-Medium) and centre-cropped to it. An image
smaller than that size is rejected rather than upscaled. Train with ``--train-only --prompt-data OUT_DIR/data.jsonl``.

**Video.** A video family's pixel size is ``(F, H, W, 3)`` (``family.image_shape``; Wan: ``4k + 1`` frames). Each
clip is decoded with PyAV (``pip install 'miles[video]'``; FFmpeg's decoders, bundled in its wheels): its first F
frames in presentation order, each fitted to ``H × W`` as an image is (Lanczos cover, centre crop), then the family's
VAE encodes the clip (Wan: the normalised video latent ``(C, F', H/8, W/8)``). A clip shorter than F frames or
smaller than ``H × W`` is rejected, and so is a still image for a video family or a clip for an image family. The
records are the GAN head's real data of a video DMD2 run (``--dmd2-gan-real-data OUT_DIR/data.jsonl``).
"""

import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.rollout import offline_files
from miles.rollout.data_source import jsonl_values
from miles.rollout.offline_files import OfflineDataError

__all__ = [
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "encode_image_folder",
    "fit_image",
    "fit_video",
    "list_images",
    "main",
    "read_caption_extras",
    "read_captions",
]

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".mov", ".avi", ".gif")
MANIFEST = "encode_images.json"
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def list_images(image_dir: str | Path, *, video: bool = False) -> list[Path]:
    """The image files (``video``: the video files) directly in ``image_dir``, sorted by name.

    Raises:
        OfflineDataError: if the directory does not exist, holds no such file, holds files of the other kind (a
            still image for a video family, a clip for an image family), or two files share a file stem (they would
            write the same latent file).
    """
    image_dir = Path(image_dir)
    if not image_dir.is_dir():
        raise OfflineDataError(f"image directory {image_dir} does not exist")
    suffixes, other = (VIDEO_SUFFIXES, IMAGE_SUFFIXES) if video else (IMAGE_SUFFIXES, VIDEO_SUFFIXES)
    files = sorted(p for p in image_dir.iterdir() if p.is_file())
    images = [p for p in files if p.suffix.lower() in suffixes]
    # .gif is a clip for a video family; an image family reads no .gif at all (a frame of it would be a guess)
    wrong = [p for p in files if p.suffix.lower() in other and p.suffix.lower() not in suffixes]
    if wrong:
        kind = "a still image" if video else "a video file"
        family = "a video family encodes clips" if video else "an image family encodes images"
        raise OfflineDataError(f"{wrong[0]} is {kind}, but {family}; move it out of {image_dir}")
    if not images:
        raise OfflineDataError(f"image directory {image_dir} holds no {'/'.join(suffixes)} file")
    stems: dict[str, Path] = {}
    for image in images:
        if image.stem in stems:
            raise OfflineDataError(f"images {stems[image.stem].name} and {image.name} share the name {image.stem!r}")
        stems[image.stem] = image
    return images


def read_captions(path: str | Path) -> dict[str, str]:
    """``{file_name: prompt}`` of a captions JSONL file (one ``{"file_name": ..., "prompt": ...}`` per line).

    Raises:
        OfflineDataError: for a missing file, a line that is not such an object (``file:line``), or a file name given
            twice.
    """
    path = Path(path)
    if not path.is_file():
        raise OfflineDataError(f"captions file {path} does not exist")
    captions: dict[str, str] = {}
    for line_no, record in jsonl_values(path, error=OfflineDataError):
        if not (
            isinstance(record, dict)
            and isinstance(record.get("file_name"), str)
            and isinstance(record.get("prompt"), str)
        ):
            raise OfflineDataError(f'{path}:{line_no} must be {{"file_name": "<image file>", "prompt": "<text>"}}')
        if record["file_name"] in captions:
            raise OfflineDataError(f"{path}:{line_no} captions {record['file_name']} a second time")
        captions[record["file_name"]] = record["prompt"]
    return captions


def read_caption_extras(path: str | Path) -> dict[str, dict[str, Any]]:
    """``{file_name: {key: value}}``: the keys of each captions line other than ``file_name`` and ``prompt`` (an edit
    family's ``condition_image``), for the lines that have any; call after :func:`read_captions` has checked the
    file."""
    extras = {}
    for _, record in jsonl_values(Path(path), error=OfflineDataError):
        rest = {key: value for key, value in record.items() if key not in ("file_name", "prompt")}
        if rest:
            extras[record["file_name"]] = rest
    return extras


def _caption(image: Path, captions: dict[str, str], prompt: str | None) -> str:
    if image.name in captions:
        return captions[image.name]
    sidecar = image.with_suffix(".txt")
    if sidecar.is_file():
        return sidecar.read_text(encoding="utf-8").strip()
    if prompt is not None:
        return prompt
    raise OfflineDataError(
        f"image {image} has no caption: add {sidecar.name} beside it, a line in --captions, or pass --prompt"
    )


def _open_video(path: Path):
    """``av.open(path)`` with its first video stream; an unreadable file or missing PyAV is one error line."""
    try:
        import av
    except ImportError as exc:
        raise OfflineDataError(
            f"reading {path} needs PyAV, the video decoder: pip install 'miles[video]' (or pip install av)"
        ) from exc
    try:
        container = av.open(str(path))
    except (av.FFmpegError, OSError) as exc:
        raise OfflineDataError(f"video {path} is not a readable video ({exc})") from exc
    if not container.streams.video:
        container.close()
        raise OfflineDataError(f"video {path} has no video stream")
    return container


def _check_size(path: Path, shape: tuple[int, ...]) -> None:
    """Reject an unreadable or too small image or clip from its header alone (no decoding)."""
    from PIL import Image, UnidentifiedImageError

    height, width, _ = shape[-3:]
    if len(shape) == 4:
        with _open_video(path) as container:
            stream = container.streams.video[0]
            w, h = stream.codec_context.width, stream.codec_context.height
        if w < width or h < height:
            raise OfflineDataError(
                f"video {path} is {w}×{h} px, smaller than the pipeline's {width}×{height}; upscale it or leave it out"
            )
        return
    try:
        with Image.open(path) as opened:
            w, h = opened.size
            if opened.getexif().get(0x0112) in (5, 6, 7, 8):  # EXIF orientations that turn the image by 90°
                w, h = h, w
    except (UnidentifiedImageError, OSError) as exc:
        raise OfflineDataError(f"image {path} is not a readable image ({exc})") from exc
    if w < width or h < height:
        raise OfflineDataError(
            f"image {path} is {w}×{h} px, smaller than the pipeline's {width}×{height}; upscale it or leave it out"
        )


def fit_image(path: str | Path, shape: tuple[int, int, int]) -> np.ndarray:
    """Load an image and fit it to ``shape``: upright (EXIF), converted to ``C`` channels, resized with Lanczos so
    that it covers ``H × W`` (aspect ratio kept), centre-cropped.

    Args:
        shape: the pipeline's ``(H, W, C)`` (``family.image_shape``), C in 1, 3, 4.

    Returns:
        uint8 ``(H, W, C)``.

    Raises:
        OfflineDataError: if the file is not a readable image, or is smaller than ``H × W`` in either dimension.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened).convert(_MODES[shape[2]])
    except (UnidentifiedImageError, OSError) as exc:
        raise OfflineDataError(f"image {path} is not a readable image ({exc})") from exc
    return _fit(image, shape, f"image {path}")


def fit_video(path: str | Path, shape: tuple[int, int, int, int]) -> np.ndarray:
    """Decode a clip's first ``F`` frames (PyAV, presentation order) and fit each to ``H × W`` as :func:`fit_image`
    fits an image (RGB, Lanczos cover, centre crop).

    Args:
        shape: the video family's ``(F, H, W, 3)`` (``family.image_shape``).

    Returns:
        uint8 ``(F, H, W, 3)``.

    Raises:
        OfflineDataError: if PyAV is not installed, the file is not a readable video, has fewer than ``F`` frames or
            is smaller than ``H × W``.
    """
    from PIL import Image

    frames, height, width, channels = shape
    if channels != 3:
        raise OfflineDataError(f"video {path}: a video family's pixels are RGB, the pipeline asks for {channels}")
    fitted = []
    with _open_video(Path(path)) as container:
        import av  # importable: _open_video checked it

        try:
            for frame in container.decode(video=0):
                image = Image.fromarray(frame.to_ndarray(format="rgb24"))
                fitted.append(_fit(image, (height, width, 3), f"video {path}"))
                if len(fitted) == frames:
                    break
        except av.FFmpegError as exc:
            raise OfflineDataError(f"video {path} could not be decoded ({exc})") from exc
    if len(fitted) < frames:
        raise OfflineDataError(f"video {path} has {len(fitted)} frames, the pipeline's clips have {frames}")
    return np.stack(fitted)


def _fit(image, shape: tuple[int, int, int], what: str) -> np.ndarray:
    """A PIL image (already in the right mode) resized with Lanczos to cover ``H × W`` and centre-cropped; uint8
    ``(H, W, C)``."""
    from PIL import Image

    height, width, channels = shape
    w, h = image.size
    if w < width or h < height:
        raise OfflineDataError(
            f"{what} is {w}×{h} px, smaller than the pipeline's {width}×{height}; upscale it or leave it out"
        )
    scale = max(width / w, height / h)
    size = (max(width, round(w * scale)), max(height, round(h * scale)))
    if size != (w, h):
        image = image.resize(size, Image.Resampling.LANCZOS)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    array = np.array(image.crop((left, top, left + width, top + height)), dtype=np.uint8)  # a writable copy
    return array.reshape(height, width, channels)


def encode_image_folder(
    pipeline: str | Path,
    image_dir: str | Path,
    out_dir: str | Path,
    *,
    captions: str | Path | None = None,
    prompt: str | None = None,
    batch_size: int = 8,
    progress: bool | None = None,
    family_name: str | None = None,
) -> dict[str, Any]:
    """Fit, caption and encode every image (a video family: every clip) of ``image_dir``; write the latent records
    to ``out_dir``.

    Every image's caption and size are checked (from its header) before the VAE runs, so a bad image fails in
    seconds; images are decoded one batch at a time. A video family (``family.image_shape`` of 4 axes,
    ``(F, H, W, 3)``) reads clips with :func:`fit_video` and its ``images_to_latents`` takes ``(B, F, H, W, 3)``.

    Args:
        pipeline: a pipeline directory of any model family; its ``images_to_latents`` encodes the images (on the
            CPU, in float32).
        image_dir: the image folder (not searched recursively).
        out_dir: where ``latents/``, ``data.jsonl`` and ``encode_images.json`` go (created; files replaced).
        captions: JSONL of ``{"file_name", "prompt"}``; see the module docstring for the caption order. Its lines'
            other keys go into their images' records unchanged.
        prompt: the caption of images without one.
        batch_size: images per ``images_to_latents`` call.
        progress: show a tqdm bar (None: when there is more than one batch and stderr is a terminal).
        family_name: a registered family name or a dotted path to a family class (the trainer's
            ``--diffusion-model-family``); None reads ``model_index.json``. The family needs a pixel codec
            (:class:`miles.models.capabilities.PixelCodec`).

    Returns:
        the manifest written to ``encode_images.json``: ``{"pipeline", "family", "image_dir", "image_shape",
        "latent_shape", "count"}``.

    Raises:
        OfflineDataError: for a missing or unsupported pipeline, a missing image folder, an unreadable, too small or
            uncaptioned image (or clip, or one too short), a file of the other kind, a bad captions file, an unwritable ``out_dir`` or a batch size below 1.
    """
    from miles.models import PixelCodec

    family = offline_files.open_family(pipeline, family_name, batch_size, needs=PixelCodec)
    pipeline, out_dir = Path(pipeline), Path(out_dir)
    try:
        shape = family.image_shape(pipeline)
        latent_shape = family.latent_shape(pipeline)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise OfflineDataError(f"pipeline {pipeline}: {exc}") from exc
    video = len(shape) == 4
    images = list_images(image_dir, video=video)
    fit = fit_video if video else fit_image
    caption_map = read_captions(captions) if captions is not None else {}
    extras = read_caption_extras(captions) if captions is not None else {}
    unused = set(caption_map) - {image.name for image in images}
    if unused:
        logger.warning("%d captions name no image of %s, e.g. %s", len(unused), image_dir, sorted(unused)[0])
    prompts = [_caption(image, caption_map, prompt) for image in images]
    for image in images:
        _check_size(image, shape)
    offline_files.ensure_writable_dir(out_dir, "latents")

    records = []
    for start, batch in offline_files.batches(images, batch_size, progress, "image", "encoding images"):
        pixels = torch.from_numpy(np.stack([fit(image, shape) for image in batch]))
        latents = family.images_to_latents(pixels).float().cpu()
        for offset, latent in enumerate(latents):
            image = images[start + offset]
            if tuple(latent.shape) != tuple(latent_shape):
                raise OfflineDataError(
                    f"image {image} encodes to a latent of shape {tuple(latent.shape)}, but the denoiser takes "
                    f"{tuple(latent_shape)}; is the pipeline's VAE config consistent with its transformer?"
                )
            name = f"latents/{image.stem}.safetensors"
            offline_files.save_tensors(
                out_dir / name, {"latent": latent}, {"file_name": image.name, "family": family.name}
            )
            record = {"prompt": prompts[start + offset], "latent": name, "file_name": image.name}
            records.append({**extras.get(image.name, {}), **record})
    offline_files.write_records(out_dir / "data.jsonl", records)
    logger.info("encoded %d images of %s to %s", len(records), image_dir, out_dir)
    return offline_files.write_manifest(
        out_dir / MANIFEST,
        pipeline,
        family,
        image_dir=str(Path(image_dir).resolve()),
        image_shape=list(shape),
        latent_shape=list(latent_shape),
        count=len(records),
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m miles.rollout.encode_images PIPELINE IMAGE_DIR OUT_DIR [--captions F | --prompt P]``; returns the
    exit code (0, or 2 after one error line on stderr)."""
    parser = offline_files.command_parser(
        "python -m miles.rollout.encode_images",
        "Encode a folder of images or video clips to latent records (data.jsonl + latents/) with the pipeline's VAE.",
        ("image_dir", "folder of .png / .jpg / .webp images (a video family: .mp4 / .mkv / .webm / .mov clips)"),
        "output directory",
        batch_size=8,
        batch_help="images per encoder call",
    )
    parser.add_argument("--captions", default=None, help='JSONL of {"file_name": ..., "prompt": ...} per image')
    parser.add_argument("--prompt", default=None, help="caption of every image without --captions line or .txt")

    def summary(manifest: dict, out: Path) -> str:
        return (
            f"encoded {manifest['count']} images to latents {tuple(manifest['latent_shape'])} in {out}; "
            f"train with --train-only --prompt-data {out / 'data.jsonl'}"
        )

    return offline_files.run_command(parser, argv, encode_image_folder, ("captions", "prompt"), summary)


if __name__ == "__main__":
    sys.exit(main())
