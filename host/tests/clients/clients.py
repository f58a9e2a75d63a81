"""Real clients against a running `sdhost serve` (host/tests/serve.rs runs this).

    python clients.py BASE_URL API_KEY USER:PASS MODEL_NAME

The official `openai` SDK and the `webuiapi` A1111 client (both pinned in
scripts/client-venv.sh) make the calls front-ends make, against the tiny SD 1.x
fixture; every check prints `ok NAME` and the first failure raises (exit 1).
"""

import base64
import io
import sys

import openai
import webuiapi
from PIL import Image

url, key, basic, model = sys.argv[1:5]
user, password = basic.split(":", 1)
host_port = url.removeprefix("http://")
host, port = host_port.rsplit(":", 1)


def ok(name):
    print(f"ok {name}", flush=True)


def png_size(b64):
    return Image.open(io.BytesIO(base64.b64decode(b64))).size


# --- the openai SDK -----------------------------------------------------
client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)

ids = [m.id for m in client.models.list()]
assert model in ids, ids
assert client.models.retrieve(model).id == model
ok("openai models.list and models.retrieve")

r = client.images.generate(prompt="a red cube", size="64x64", n=2, response_format="b64_json",
                           extra_body={"steps": 2, "seed": 5})
assert len(r.data) == 2 and all(png_size(d.b64_json) == (64, 64) for d in r.data), r
ok("openai images.generate")

r = client.images.generate(prompt="a red cube", size="64x64", response_format="url", extra_body={"steps": 2})
# The URL works without the key, as OpenAI's do.
import urllib.request
with urllib.request.urlopen(r.data[0].url) as got:
    assert Image.open(io.BytesIO(got.read())).size == (64, 64)
ok("openai images.generate with response_format url")

try:
    client.images.generate(prompt="x", size="65x64", extra_body={"steps": 2})
    raise AssertionError("a size that is no multiple of 8 was accepted")
except openai.APIStatusError as e:
    # The server's own message reaches the SDK's user, with the field.
    assert e.status_code in (400, 422), e.status_code
    assert "65" in e.message and e.body["param"] == "size", (e.message, e.body)
ok("openai error shape (message and param)")

try:
    openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key", max_retries=0).models.list()
    raise AssertionError("a wrong key was accepted")
except openai.AuthenticationError as e:
    assert e.body["code"] == "invalid_api_key", e.body
ok("openai wrong key is AuthenticationError")

init = io.BytesIO()
Image.new("RGB", (64, 64), (200, 30, 30)).save(init, format="PNG")
r = client.images.edit(image=("init.png", init.getvalue(), "image/png"), prompt="a blue cube", size="64x64",
                       extra_body={"steps": 4, "strength": 0.6})
assert png_size(r.data[0].b64_json) == (64, 64)
ok("openai images.edit (multipart)")

# Streaming: the model has made images above, so previews come first.
events = list(client.images.generate(prompt="a green cube", size="64x64", stream=True, partial_images=2,
                                     extra_body={"steps": 120, "seed": 9}))
types = [e.type for e in events]
assert types[-1] == "image_generation.completed", types
partial = [e for e in events if e.type == "image_generation.partial_image"]
assert 1 <= len(partial) <= 2, types
assert [e.partial_image_index for e in partial] == list(range(len(partial)))
assert png_size(events[-1].b64_json) == (64, 64)
ok(f"openai streaming ({len(partial)} partial images, then the image)")

# --- webuiapi (A1111's API, HTTP Basic as --api-auth) ---------------------
api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler a", steps=2)
api.set_auth(user, password)

names = api.util_get_model_names()
assert any(model in n for n in names), names
ok("webuiapi model names")

r = api.txt2img(prompt="a cat", width=64, height=64, steps=2, seed=11, cfg_scale=7)
assert r.image.size == (64, 64) and r.info["seed"] == 11, (r.image.size, r.info.get("seed"))
ok("webuiapi txt2img")

r = api.img2img(images=[r.image], prompt="a dog", width=64, height=64, steps=4, denoising_strength=0.5, seed=3)
assert r.image.size == (64, 64)
ok("webuiapi img2img")

mask = Image.new("L", (64, 64), 0)
mask.paste(255, (16, 16, 48, 48))
r = api.img2img(images=[r.image], mask_image=mask, prompt="a hat", width=64, height=64, steps=4,
                denoising_strength=0.75, seed=4)
assert r.image.size == (64, 64)
ok("webuiapi inpainting")

# A1111's Extras tab: the image enlarged by a built-in upscaler.
r = api.extra_single_image(image=r.image, upscaler_1=webuiapi.Upscaler.Lanczos, upscaling_resize=2)
assert r.image.size == (128, 128), r.image.size
ok("webuiapi extra_single_image")

r = api.extra_batch_images(images=[r.image, Image.new("RGB", (64, 48), (0, 90, 200))], upscaler_1="Nearest",
                           upscaling_resize=1.5)
assert [i.size for i in r.images] == [(192, 192), (96, 72)], [i.size for i in r.images]
ok("webuiapi extra_batch_images")

progress = api.get_progress()
assert "progress" in progress and "state" in progress, progress
ok("webuiapi progress")

options = api.get_options()
assert model in options["sd_model_checkpoint"], options["sd_model_checkpoint"]
ok("webuiapi options")

bad = webuiapi.WebUIApi(host=host, port=int(port))
bad.set_auth(user, "wrong")
try:
    bad.txt2img(prompt="x", width=64, height=64, steps=1)
    raise AssertionError("a wrong password was accepted")
except RuntimeError as e:
    assert "401" in str(e), e
ok("webuiapi wrong password is refused")
print("all clients ok")
