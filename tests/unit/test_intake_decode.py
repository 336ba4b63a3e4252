"""Decoding: format by content, pixel limits before decoding, EXIF orientation, modes → RGB."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest
from PIL import Image

from llava.errors import ImageTooLarge, NotAnImage
from llava.intake import IntakePolicy, decode_image
from llava.intake.decode import DecodeBudget
from tests.intake_servers import image_bytes, png_header

POLICY = IntakePolicy()
RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def near(pixel, expected, tolerance=12):
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, expected, strict=True))


@pytest.mark.parametrize(
    ("width", "height"),
    [(20000, 20000), (4000, 4250)],  # past PIL's own bomb limit; past only ours (16 MP)
)
def test_huge_declared_size_is_refused_without_decoding(width, height):
    data = png_header(width, height)
    assert len(data) < 100
    tracemalloc.start()
    try:
        # the project's documented limit, checked first: not Pillow's decompression-bomb text
        with pytest.raises(ImageTooLarge, match=rf"{width}x{height} .*intake\.max_pixels") as e:
            decode_image(data, POLICY)
        assert "bomb" not in str(e.value)
        assert tracemalloc.get_traced_memory()[1] < 10 * 1024 * 1024
    finally:
        tracemalloc.stop()


def test_the_default_pixel_limit_is_16_megapixels():
    with pytest.raises(ImageTooLarge, match=r"4000x4250 = 17000000 pixels.*= 16000000"):
        decode_image(png_header(4000, 4250), POLICY)
    # 16 MP exactly passes the limit: this header holds no pixels, so the decode fails later
    with pytest.raises(NotAnImage, match="cannot be decoded"):
        decode_image(png_header(4000, 4000), POLICY)


def test_max_pixels_is_configurable():
    data = image_bytes(Image.new("RGB", (100, 100)))
    with pytest.raises(ImageTooLarge, match=r"100x100 = 10000 pixels.*intake\.max_pixels"):
        decode_image(data, IntakePolicy(max_pixels=9999))
    assert decode_image(data, IntakePolicy(max_pixels=10000)).size == (100, 100)


@pytest.mark.parametrize("data", [b"", b"hello, I am a .png", b"\x89PNG\r\n\x1a\n" + b"\0" * 20])
def test_non_images_are_refused(data):
    with pytest.raises(NotAnImage, match=r"PNG.*intake\.formats"):
        decode_image(data, POLICY)


def test_truncated_jpeg_is_refused():
    data = image_bytes(Image.effect_noise((64, 64), 64).convert("RGB"), "JPEG")
    with pytest.raises(NotAnImage, match="JPEG image cannot be decoded"):
        decode_image(data[: len(data) // 2], POLICY)


def test_formats_outside_the_policy_are_not_parsed():
    tiff = image_bytes(Image.new("RGB", (4, 4), RED), "TIFF")
    with pytest.raises(NotAnImage, match=r"intake\.formats"):
        decode_image(tiff, POLICY)
    policy = IntakePolicy.from_mapping({"formats": ["png", "tiff"]})
    assert decode_image(tiff, policy).getpixel((0, 0)) == RED


def test_exif_orientation_is_applied():
    """Stored 40x20, left half red; orientation 6 means "rotate 90° clockwise to display"."""
    stored = Image.new("RGB", (40, 20), BLUE)
    stored.paste(RED, (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    image = decode_image(image_bytes(stored, "JPEG", exif=exif, quality=95), POLICY)
    assert image.size == (20, 40)
    assert near(image.getpixel((10, 5)), RED) and near(image.getpixel((10, 35)), BLUE)


def _palette_with_transparency() -> Image.Image:
    image = Image.new("P", (2, 1))
    image.putpalette([255, 0, 0, 0, 0, 255])
    image.putpixel((1, 0), 1)
    image.info["transparency"] = 1
    return image


def _grey16() -> Image.Image:
    image = Image.new("I;16", (2, 1))
    image.putpixel((0, 0), 65535)
    image.putpixel((1, 0), 32768)
    return image


@pytest.mark.parametrize(
    ("image", "fmt", "expected"),
    [
        (Image.new("RGBA", (2, 1), (255, 0, 0, 0)), "PNG", [WHITE, WHITE]),
        (Image.new("RGBA", (2, 1), (255, 0, 0, 255)), "PNG", [RED, RED]),
        (Image.new("LA", (2, 1), (0, 0)), "PNG", [WHITE, WHITE]),
        (Image.new("RGB", (2, 1), BLUE).convert("P"), "PNG", [BLUE, BLUE]),
        (_palette_with_transparency(), "PNG", [RED, WHITE]),
        (_palette_with_transparency(), "GIF", [RED, WHITE]),
        (Image.new("CMYK", (2, 1), (0, 255, 255, 0)), "JPEG", [RED, RED]),
        (_grey16(), "PNG", [WHITE, (128, 128, 128)]),
        (Image.new("L", (2, 1), 77), "PNG", [(77, 77, 77)] * 2),
        (Image.new("1", (2, 1), 1), "PNG", [WHITE, WHITE]),
        (Image.new("RGB", (2, 1), RED), "BMP", [RED, RED]),
        (Image.new("RGBA", (2, 1), (0, 0, 255, 0)), "WEBP", [WHITE, WHITE]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_every_mode_comes_out_rgb(image, fmt, expected):
    source_mode = image.mode
    result = decode_image(image_bytes(image, fmt), POLICY)
    assert result.mode == "RGB", source_mode
    pixels = [result.getpixel((x, 0)) for x in range(2)]
    assert all(near(p, e) for p, e in zip(pixels, expected, strict=True)), (source_mode, pixels)


@pytest.mark.parametrize(
    ("fmt", "size"),
    [("PNG", (3000, 2000)), ("JPEG", (3000, 2000)), ("PNG", (700, 200)), ("GIF", (1000, 1000))],
)
def test_a_large_image_is_decoded_only_as_large_as_the_model_needs(fmt, size):
    """Shorter side kept between 2x and 4x the model's side (JPEG by its decoder's draft),
    aspect and colour kept; an image already small enough comes out untouched."""
    image = Image.new("RGB", size, BLUE)
    image.paste(RED, (0, 0, size[0] // 2, size[1]))
    decoded = decode_image(image_bytes(image, fmt), POLICY, fit=64)
    if min(size) < 4 * 64:
        assert decoded.size == size
    else:
        assert 2 * 64 <= min(decoded.size) < 4 * 64
        assert abs(decoded.width / decoded.height - size[0] / size[1]) < 0.05
    assert near(decoded.getpixel((2, 2)), RED)
    assert near(decoded.getpixel((decoded.width - 3, 2)), BLUE)
    assert decoded.mode == "RGB"


def test_decodes_wait_while_the_memory_they_take_is_over_the_budget():
    budget, entered, release = DecodeBudget(), [], {n: threading.Event() for n in "abc"}

    def decode(name: str, needed: int) -> None:
        with budget.hold(needed, 500):
            entered.append(name)
            release[name].wait(10)  # the decode's work, until the test lets it end

    def until(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.005)

    threads = {
        n: threading.Thread(target=decode, args=(n, k))
        for n, k in zip("abc", (300, 300, 100), strict=True)
    }
    threads["a"].start()
    until(lambda: entered == ["a"])
    threads["b"].start()  # 600 > 500: waits for a
    threads["c"].start()  # 400 <= 500: enters beside a
    until(lambda: "c" in entered)
    release["c"].set()
    threads["c"].join(10)
    assert entered == ["a", "c"]
    release["a"].set()
    until(lambda: "b" in entered)
    release["b"].set()
    for thread in threads.values():
        thread.join(10)
    with budget.hold(10_000, 500):  # larger than the whole budget: runs, alone
        assert budget.held() == 10_000
    assert budget.held() == 0
