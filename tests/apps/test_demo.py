"""`visar demo`: the comparison it computes, the server driven by gradio_client, and a real browser.

The server tests start `python -m visar demo` on a free localhost port, as a user does, and talk to
it over HTTP only; the browser test loads the page in headless Chromium (Debian's package, driven
through the DevTools protocol, `tests/chromium.py`), clicks Generate and checks the images appear.
"""

import json
import os
import re
import time

import numpy as np
import pytest
import torch
from demo_server import free_port, needs, start_demo, stop, wait_for
from PIL import Image

import visar
from visar.accel import METHODS, reference_method
from visar.accel.policy import auto
from visar.accel.policy.auto import DEFAULT_CANDIDATES
from visar.apps.demo import (
    EMPTY_VIEWS,
    MAX_OPTIONS,
    ModelCache,
    auto_note,
    commit_heatmap,
    compare,
    default_options,
    example_prompt,
    guarantee_note,
    model_choices,
    page_handlers,
    parse_options,
    speedup_text,
    summary_markdown,
)
from visar.errors import VisarError

MODEL = "visar-tiny-random"


# -- the comparison, in-process (quick) --------------------------------------------------------------


@pytest.fixture(scope="module")
def cache():
    return ModelCache(device="cpu")


def option_texts(method: str, **values) -> list[str]:
    texts = default_options(method, MODEL)
    texts.update({k: json.dumps(v) for k, v in values.items()})
    return list(texts.values()) + [""] * (MAX_OPTIONS - len(texts))


def test_compare_runs_ar_and_the_method_on_one_seed(cache):
    ar, fast, summary, heatmap, commit_pass, stats = compare(
        cache, MODEL, "3", "", "", "sjd", 5, 1.0, 1.0, 0, 1.0, option_texts("sjd", window=8)
    )
    pipe = cache.get(MODEL)
    reference = pipe.generate(class_labels=[3], method="ar", seed=5)  # image 0 draws from seed 5
    assert np.array_equal(np.asarray(ar.resize((64, 64), Image.NEAREST)), np.asarray(reference.images[0]))
    assert ar.size == fast.size == (256, 256)
    assert stats["ar"]["forward_passes"] == 256 and stats["ar"]["step_compression"] == 1.0
    passes = stats["method"]["forward_passes"]
    assert passes < 256 and stats["method"]["step_compression"] == pytest.approx(256 / passes)
    assert stats["method"]["lossless"] is True and stats["method"]["options"] == {"window": 8, **_rest("sjd")}
    # sampling against sampling: what a call spends once (auto's pass costs) is shown apart
    assert stats["speedup"] == pytest.approx(stats["ar"]["sampling_s"] / stats["method"]["sampling_s"])
    assert all(0 <= side["setup_s"] < side["wall_s"] for side in (stats["ar"], stats["method"]))
    assert commit_pass.shape == (16, 16) and int(commit_pass.max()) == passes
    assert torch.bincount(commit_pass.reshape(-1)).sum() == 256
    assert "| forward passes | 256 |" in summary and "| lossless | yes | yes |" in summary
    assert "| one-time set-up (not in the speed-up) |" in summary and summary.split("\n\n")[1] == "class 3"
    # sjd refills: its image was decoded in the device's running batch, which the page says
    assert stats["method"]["shared_with"] == 0 and stats["method"]["acceptance_rate"] is None
    assert "sjd decoded its image in the device's running batch, alone when it joined" in summary
    assert heatmap.width == 256


@pytest.mark.one_thread  # each image against its generate alone, bit for bit
def test_sessions_that_click_together_share_the_method_s_running_batch(cache):
    """Three clicks made while the device is busy (a call holds it): their sjd sides join one running
    batch (1, then 2 other images in it as each joined), each image is still generate's alone for its
    seed, and each reference runs after, on its own."""
    import threading

    pipe = cache.get(MODEL)
    # one torch thread in the device thread too: OpenMP's thread count is a thread's own, so the one_thread
    # marker (this thread's) does not reach a thread made before it
    threads = cache.shared.call(torch.get_num_threads).result()
    cache.shared.call(torch.set_num_threads, 1).result()
    try:
        release = threading.Event()
        held = cache.shared.call(release.wait, 60)
        results = {}

        def click(seed):
            results[seed] = compare(cache, MODEL, "3", "", "", "sjd", seed, 1.0, 1.0, 0, 1.0, option_texts("sjd"))

        clicks = [threading.Thread(target=click, args=(seed,)) for seed in range(3)]
        for thread in clicks:
            thread.start()
        deadline = time.monotonic() + 30
        while cache.shared.in_flight()[1] < 3 and time.monotonic() < deadline:  # all three method sides wait
            time.sleep(0.01)
        release.set()
        held.result(30)
        for thread in clicks:
            thread.join(120)
        assert sorted(results[seed][-1]["method"]["shared_with"] for seed in range(3)) == [0, 1, 2]
        for seed in range(3):
            ar, fast, summary, *_, stats = results[seed]
            alone, reference = (
                cache.shared.call(pipe.generate, class_labels=[3], method=method, seed=seed).result().images[0]
                for method in ("sjd", "ar")
            )  # in the device thread, as the clicks' images were made
            assert np.array_equal(np.asarray(fast.resize((64, 64), Image.NEAREST)), np.asarray(alone)), seed
            assert np.array_equal(np.asarray(ar.resize((64, 64), Image.NEAREST)), np.asarray(reference)), seed
        assert not np.array_equal(np.asarray(results[0][1]), np.asarray(results[1][1]))  # the seeds differ
    finally:
        cache.shared.call(torch.set_num_threads, threads).result()


def summary_of(ar, fast, stats) -> str:
    return summary_markdown(stats)


def test_a_speedup_below_one_is_not_bolded_as_a_win():
    assert speedup_text(2.5) == "**2.50x**" and speedup_text(1.0) == "**1.00x**"
    assert speedup_text(0.89) == "0.89x (slower)" and speedup_text(None) == "- (the same decoding)"


def test_the_first_and_second_click_time_sampling_alike(cache, tmp_path, monkeypatch):
    """auto's first call on a model times a few AR steps (the reference its tuning is kept against):
    that time is in the set-up row, not in the sampling time the speed-up compares, so a first and a
    second click compare the same work."""
    import time as clock

    from visar.accel.policy import auto

    monkeypatch.setenv("VISAR_CACHE", str(tmp_path / "cache"))  # no tuning kept from another test
    auto.forget_tunings()
    spent, probe = [], auto.ar_step_seconds

    def timed(*args, **kwargs):
        start = clock.perf_counter()
        try:
            return probe(*args, **kwargs)
        finally:
            spent.append(clock.perf_counter() - start)

    monkeypatch.setattr(auto, "ar_step_seconds", timed)
    args = (cache, MODEL, "3", "", "", "auto", 0, 1.0, 1.0, 0, 1.0, [""] * MAX_OPTIONS)
    clicks = []
    for _ in range(2):
        spent.clear()
        *_, stats = compare(*args)
        clicks.append((stats, sum(spent)))
    (first, measuring), (second, again) = clicks
    assert measuring > 0 and first["method"]["setup_s"] >= measuring and again == 0  # once a process
    assert first["method"]["sampling_s"] <= first["method"]["wall_s"] - measuring
    for stats in (first, second):
        if stats["speedup"] is not None:  # auto drafted: sampling against sampling
            assert stats["speedup"] == pytest.approx(stats["ar"]["sampling_s"] / stats["method"]["sampling_s"])
    auto.forget_tunings()


def test_choosing_a_model_clears_the_last_result_and_a_text_model_opens_with_a_prompt(cache):
    gr = needs("gradio")
    select_model = page_handlers(gr, cache)["select_model"]
    updates = select_model("visar-tiny-t2i", "auto")
    views = updates[-len(EMPTY_VIEWS) :]
    assert views[0]["value"] is None and views[1:] == EMPTY_VIEWS[1:]  # images, table, plot, figures, status
    assert updates[1]["value"] == example_prompt(cache.get("visar-tiny-t2i"))
    # the shapes world's encoder reads every word of it; a class model's prompt box is emptied
    assert example_prompt(cache.get("visar-tiny-t2i")) == "a photo of a red circle above a blue square"
    assert select_model(MODEL, "auto")[1]["value"] == ""


def test_a_bad_input_is_refused_before_the_result_is_cleared(cache):
    """The button first checks the inputs (one toast, no output touched), and only then clears and generates."""
    gr = needs("gradio")
    handlers = page_handlers(gr, cache)
    with pytest.raises(gr.Error, match="enter a prompt"):
        handlers["check_inputs"]("visar-tiny-t2i", None, "  ", "", "sjd", 0, 3.0, 1.0, 0, 1.0, *[""] * MAX_OPTIONS)
    handlers["check_inputs"](
        "visar-tiny-t2i", None, "a red circle", "", "sjd", 0, 3.0, 1.0, 0, 1.0, *[""] * MAX_OPTIONS
    )
    config = visar.apps.demo.build_demo(model=MODEL).config
    names = [d.get("api_name") for d in config["dependencies"]]
    check = next(d for d in config["dependencies"] if d.get("backend_fn") and not d.get("outputs") and d.get("inputs"))
    assert "generate" in names and check["trigger_after"] is None
    plot = next(c for c in config["components"] if c.get("props", {}).get("y_lim") is not None)
    assert plot["props"]["y_lim"][0] == 0  # the per-pass plot's axis starts at 0


def _rest(method):
    """The options the page sends when its fields hold the defaults (None stays unsent)."""
    return {k: v for k, v in METHODS[method].defaults.items() if v is not None and k != "window"}


def test_lossy_method_says_so(cache):
    *_, stats = compare(cache, MODEL, "1", "", "", "zipar", 0, 1.0, 1.0, 0, 1.0, option_texts("zipar", s=4))
    assert stats["method"]["lossless"] is False and stats["method"]["forward_passes"] == 16 + 15 * 4
    *_, stats = compare(cache, MODEL, "1", "", "", "zipar", 0, 1.0, 1.0, 0, 1.0, option_texts("zipar", s=16))
    assert stats["method"]["lossless"] is True  # s >= the grid width is plain raster order


def test_the_note_says_what_the_chosen_method_guarantees():
    """Lossless methods: the model's own distribution; lossy ones say so, what they trade and when they are exact."""
    assert "**mc-sjd** is lossless: it samples the model's own distribution" in guarantee_note("mc-sjd")
    zipar = guarantee_note("zipar")
    assert "**zipar** is lossy: it trades exactness for speed" in zipar
    for same_passes in ("var-prune", "halton", "mar-cache"):  # cheaper passes, not fewer: no promise of fewer
        assert "fewer forward passes" not in guarantee_note(same_passes).split("(")[0], same_passes
    assert METHODS["zipar"].description in zipar and "exact when s >= the grid width" in zipar
    assert "lossless" not in guarantee_note("halton") and "is lossy" in guarantee_note("halton")
    assert {guarantee_note(name) for name in METHODS}.isdisjoint({""})  # every method has its note


def test_the_negative_prompt_field_reaches_both_sides(cache):
    """The field under the prompt: both images are generated with it (same seed); empty is the model's own."""
    args = ("visar-tiny-t2i", None, "a red circle")
    tail = (0, 3.0, 1.0, 0, 1.0, option_texts("sjd"))
    ar, fast, *_, stats = compare(cache, *args, "green triangle", "sjd", *tail)
    pipe = cache.get("visar-tiny-t2i")
    kwargs = dict(prompts=["a red circle"], guidance_scale=3.0, seed=0, method="ar")
    expected = pipe.generate(negative_prompt="green triangle", **kwargs).images[0]
    assert np.array_equal(np.asarray(ar.resize(expected.size, Image.NEAREST)), np.asarray(expected))
    assert stats["negative_prompt"] == "green triangle" and stats["method"]["lossless"] is True
    assert summary_of(ar, fast, stats).split("\n\n")[1] == "prompt: a red circle; negative prompt: green triangle"
    ar_plain, *_, plain_stats = compare(cache, *args, "  ", "sjd", *tail)
    own = pipe.generate(**kwargs).images[0]  # an empty field: the null caption
    assert np.array_equal(np.asarray(ar_plain.resize(own.size, Image.NEAREST)), np.asarray(own))
    assert "negative_prompt" not in plain_stats and not np.array_equal(np.asarray(own), np.asarray(expected))
    assert summary_markdown(plain_stats).split("\n\n")[1] == "prompt: a red circle; negative prompt: the model's own"
    with pytest.raises(VisarError, match="class-conditional: a negative prompt replaces"):
        compare(cache, MODEL, "3", "", "blurry", "sjd", *tail)


def test_options_are_the_methods_own_with_their_defaults():
    for name, method in METHODS.items():
        texts = default_options(name, "visar-tiny-c2i")
        assert list(texts) == method.options
        if method.needs_draft and method.draft_option == "draft":
            assert texts["draft"] == "visar-tiny-c2i-draft"
    assert default_options("code", "visar-tiny-var-c2i")["refiner"] == "visar-tiny-var-c2i-refiner"
    assert default_options("gsd", MODEL)["group_size"] == "14"
    assert parse_options("sjd", ["8", "", " 2 ", "above"]) == {"window": 8, "tail": 2, "init": "above"}


def test_heatmap_colours_early_passes_dark_and_late_ones_bright():
    grid = torch.arange(1, 17).reshape(4, 4)
    picture = np.asarray(commit_heatmap(grid).convert("L"), dtype=float)
    cell = 256 // 4
    assert picture[cell // 2, cell // 2] < picture[3 * cell + cell // 2, 3 * cell + cell // 2]


GENERATORS = [name for name in model_choices() if not name.endswith(("-draft", "-refiner", "-refiner-s6"))]


def test_every_model_is_shown_with_a_method_other_than_its_reference(cache):
    """Whatever the page held (its first method, or the previous model's), choosing a model shows
    `auto` on a raster model and the kind's fastest method elsewhere, never the reference it compares with."""
    gr = needs("gradio")
    select_model = page_handlers(gr, cache)["select_model"]
    for name in GENERATORS:
        reference = reference_method(cache.get(name).model)
        for held in ("auto", "ar", "var", "maskgit", "mar", "sjd"):
            method = select_model(name, held)[3]["value"]  # after the class, prompt and negative prompt
            assert method != reference, (name, held)
            expected = {"ar": "auto", "var": "var-prune", "maskgit": "halton", "mar": "mar-cache"}[reference]
            assert method == (held if held == "sjd" and reference == "ar" else expected), (name, held)
        assert select_model(name, "auto")[-len(EMPTY_VIEWS)]["label"] == (  # the reference's image
            "plain AR" if reference == "ar" else f"{reference} (the reference)"
        )


def click(cache, **values) -> dict:
    """One Generate click of the page (its handler, in-process) -> what the page shows of it."""
    gr = needs("gradio")
    args = {"model": MODEL, "class_value": "3", "method": "auto", **values}
    *_, summary, _, _, stats, status = page_handlers(gr, cache)["generate"](
        args["model"], args["class_value"], "", "", args["method"], 0, 1.0, 1.0, 0, 1.0, *[""] * MAX_OPTIONS, None
    )
    return {"summary": summary, "note": summary.split("\n\n")[-1], "stats": stats, "status": status}


@pytest.fixture
def fresh_tuning(tmp_path, monkeypatch):
    """auto with nothing timed: no tuning of this process, none kept on disk."""
    monkeypatch.setenv("VISAR_CACHE", str(tmp_path / "cache"))
    auto.forget_tunings()
    yield
    auto.forget_tunings()


@pytest.mark.slow  # 12 to 20 clicks (about 15 s)
def test_auto_says_how_far_its_tuning_is_and_on_its_last_timed_click_what_ran_and_what_won(cache, fresh_tuning):
    """Each click while auto times says "image N of M" (N counted from the first click, M the fewest to
    the most images the walk can take, true of the walk's end); the click where the walk ends says what
    it ran apart from what won, the next click runs the winner, and the candidates never timed are named."""
    still_timing = re.compile(r"\*\*auto is still timing: image (\d+) of (\d+)(?: to (\d+))?\*\*")
    ranges = []
    for clicks in range(1, 22):
        page = click(cache)
        found = still_timing.search(page["note"])
        if found is None:
            break
        images, fewest, most = int(found[1]), int(found[2]), int(found[3] or found[2])
        assert images == clicks, page["note"]  # one image a click, counted from the first
        ranges.append((fewest, most))
    else:
        pytest.fail("auto still timing after 21 clicks")
    assert clicks > 1 and ranges[0] == (12, 20)  # the first click says how long: 3 to 5 candidates, 4 images each
    assert all(fewest <= clicks <= most for fewest, most in ranges), (clicks, ranges)  # M held true
    ended, tuning = page["stats"]["method"], page["stats"]["method"]["tuning"]
    ran, winner, timed = ended["ran"], tuning["auto_winner"], tuning["auto_timed"]
    assert winner == max(timed, key=lambda spec: timed[spec][0] / timed[spec][1])
    assert f"| auto (ran {ran}) |" in page["summary"]  # the head says what this click ran
    assert f"**auto finished timing on this click** ({clicks} images, {len(timed)} of its 5 candidates)" in page["note"]
    assert f"this click ran {ran}, the last candidate timed. The winner: **{winner}**" in page["note"]
    untimed = [spec for spec in DEFAULT_CANDIDATES.split(",") if spec not in timed]
    assert all(spec in page["note"].split("Not timed: ")[1] for spec in untimed) and bool(untimed) == (
        "Not timed: " in page["note"]
    )
    following = click(cache)
    assert following["stats"]["method"]["ran"] == winner and following["note"].startswith(f"auto ran **{winner}**")


def test_the_status_line_and_the_table_give_one_account_of_the_times(cache, fresh_tuning, monkeypatch):
    """The status line under the table gives the table's sampling times (auto's first-call probe, slowed
    here to 0.2 s, apart in both) and the table's speed-up, which is the ratio of those times."""
    probe = auto.ar_step_seconds

    def slow_probe(*args, **kwargs):
        time.sleep(0.2)
        return probe(*args, **kwargs)

    monkeypatch.setattr(auto, "ar_step_seconds", slow_probe)
    page = click(cache)
    table = re.search(r"\| sampling time \| ([\d.]+) s \| ([\d.]+) s \|", page["summary"])
    speedup = re.search(r"\| measured speed-up \(sampling time\) \| 1.00x \| (\**([\d.]+)x[^|]*) \|", page["summary"])
    assert re.findall(r"([\d.]+) s\b", page["status"])[:2] == [table[2], table[1]], page["status"]  # auto, AR
    assert f"speed-up {speedup[1]}" in page["status"]
    assert float(speedup[2]) == pytest.approx(float(table[1]) / float(table[2]), rel=0.01, abs=0.005)
    assert page["stats"]["method"]["setup_s"] >= 0.2 and "one-time set-up, not in the speed-up: auto" in page["status"]


@pytest.mark.parametrize("model, method", [(MODEL, "ar"), ("visar-tiny-var-c2i", "var")])
def test_the_reference_against_itself_reports_no_speedup(cache, model, method):
    *_, summary, _, _, stats = compare(cache, model, "3", "", "", method, 0, 1.0, 1.0, 0, 1.0, [""] * MAX_OPTIONS)
    assert stats["speedup"] is None
    assert "| measured speed-up (sampling time) | 1.00x | - (the same decoding) |" in summary and "**" not in summary


def test_auto_reports_what_it_ran_and_a_speedup_only_over_other_work(cache):
    *_, summary, _, _, stats = compare(cache, MODEL, "3", "", "", "auto", 0, 1.0, 1.0, 0, 1.0, [""] * MAX_OPTIONS)
    ran = stats["method"]["ran"]
    assert ran in DEFAULT_CANDIDATES.split(",") and f"| auto (ran {ran}) |" in summary
    assert (stats["speedup"] is None) == (ran == "ar")
    timed = stats["method"]["tuning"]["auto_tuning"]  # each timed candidate's images per second, said
    assert ran in timed and summary.endswith(auto_note(stats["method"]))


def test_a_next_scale_heatmap_is_about_square_and_names_its_reference(cache):
    sizes = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)  # VAR d16 .. d30's scales
    picture = commit_heatmap([torch.full((pn, pn), k + 1) for k, pn in enumerate(sizes)])
    maps_height = picture.height - 34  # the colour bar below
    assert 0.5 <= picture.width / maps_height <= 2, picture.size
    last_pass = (np.asarray(picture) == (253, 231, 37)).all(-1).sum()  # viridis' end: the 16 x 16 scale's colour
    assert last_pass >= 256 * 256  # the largest scale at least as large as a raster grid's heatmap
    _, _, summary, heatmap, commit_pass, stats = compare(
        cache, "visar-tiny-var-c2i", "3", "", "", "var-prune", 0, 1.0, 1.0, 0, 1.0, [""] * MAX_OPTIONS
    )
    assert 0.5 <= heatmap.width / (heatmap.height - 34) <= 2, heatmap.size
    assert "| var (the reference) | var-prune |" in summary and stats["speedup"] is not None


# -- the server --------------------------------------------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port` (Linux /proc/net/tcp, tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.add(address)
    return found


@pytest.fixture(scope="module")
def server():
    needs("gradio")
    port = free_port()
    process = start_demo(MODEL, "sjd", port)
    url = f"http://127.0.0.1:{port}/"
    wait_for(process, url)
    yield {"url": url, "port": port, "started": time.monotonic()}
    stop(process)


@pytest.fixture(scope="module")
def client(server):
    gradio_client = needs("gradio_client")
    return gradio_client.Client(server["url"], verbose=False)


def generate_args(method="sjd", model=MODEL, class_value="3", prompt="", seed=0, negative_prompt="", **options):
    texts = default_options(method, model) if method in METHODS else {}
    texts.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in options.items()})
    texts = list(texts.values()) + [""] * (MAX_OPTIONS - len(texts))
    return (model, class_value, prompt, negative_prompt, method, seed, 1.0, 1.0, 0, 1.0, *texts)


@pytest.mark.slow  # starts a server (about 10 s)
def test_server_binds_localhost_only(server):
    assert listening_addresses(server["port"]) <= {"0100007F", "00000000000000000000000001000000"}
    assert listening_addresses(server["port"])


@pytest.mark.slow
def test_client_gets_two_images_and_the_figures(client):
    ar_path, method_path, summary, heatmap_path, per_pass, stats, status = client.predict(
        *generate_args("sjd", seed=7), api_name="/generate"
    )
    ar, fast = Image.open(ar_path), Image.open(method_path)
    assert ar.size == fast.size == (256, 256)
    reference = visar.load(MODEL, device="cpu").generate(class_labels=[3], method="ar", seed=7).images[0]
    assert np.array_equal(np.asarray(ar.convert("RGB").resize((64, 64), Image.NEAREST)), np.asarray(reference))
    assert stats["ar"]["forward_passes"] == 256 and stats["method"]["method"] == "sjd"
    assert stats["method"]["lossless"] is True and 0 < stats["method"]["forward_passes"] <= 256
    assert stats["speedup"] > 0 and "measured speed-up" in summary and status.startswith("done")
    assert Image.open(heatmap_path).width >= 256
    counts = [row[1] for row in per_pass["data"]]
    assert sum(counts) == 256 and len(counts) == stats["method"]["forward_passes"]


@pytest.mark.slow
def test_method_choice_shows_its_options_with_defaults(client):
    info, note, *fields = client.predict("gsd", MODEL, api_name="/select_method")
    assert note.startswith("**gsd** is lossy: it trades exactness")
    assert "gsd" in info and "lossy (exact when group_size=1)" in info
    shown = [(f["label"], f["value"]) for f in fields if f["visible"]]
    assert shown == list(default_options("gsd", MODEL).items())
    assert ("group_size", "14") in shown and len(fields) == MAX_OPTIONS


@pytest.mark.slow
def test_the_api_names_its_endpoints_and_outputs(client):
    """gradio_client's view of the API: the three endpoints by name, every parameter and output named
    (an unlabelled output is `value_NN` there)."""
    shown = client.view_api(print_info=False, return_format="str")
    assert {"/select_model", "/select_method", "/generate"} <= set(re.findall(r'api_name="(/\w+)"', shown)), shown
    assert not re.search(r"\bvalue_\d+|parameter_\d+", shown), shown
    for named in ("model_name", "method_name", "figures_table", "all_figures", "status", "guarantee_note"):
        assert named in shown, named


@pytest.mark.slow
def test_choosing_a_model_through_the_api_takes_any_method_after_a_var_model(server):
    """A VAR model chosen, the session's method list is VAR's: `auto` is still taken (the default of a
    raster model; a VAR model's own default, var-prune, where it does not fit), and generate runs it."""
    gradio_client = needs("gradio_client")
    client = gradio_client.Client(server["url"], verbose=False)  # a session of its own: its lists change
    assert client.predict("visar-tiny-var-c2i", "auto", api_name="/select_model")[3]["value"] == "var-prune"
    assert client.predict("visar-tiny-var-c2i", "auto", api_name="/select_model")[3]["value"] == "var-prune"
    assert client.predict(MODEL, "auto", api_name="/select_model")[3]["value"] == "auto"
    client.predict("visar-tiny-var-c2i", "auto", api_name="/select_model")
    *_, stats, status = client.predict(*generate_args("auto"), api_name="/generate")
    assert stats["method"]["method"] == "auto" and status.startswith("done")


@pytest.mark.slow
def test_bad_input_is_a_message_and_the_server_keeps_serving(client, tmp_path):
    gradio_client = needs("gradio_client")
    not_a_model = tmp_path / "folder"
    not_a_model.mkdir()
    cases = [
        (generate_args(class_value="purple hexagon"), "is not a class of visar-tiny-random"),
        (generate_args(class_value="400"), "class id 400 out of range"),
        (generate_args(window=-1), "window must be an integer >= 1"),
        (generate_args(method="gsd", group_size=10**9), "option group_size=1000000000 is larger than anything"),
        (generate_args(window="x" * 300), "at most 200 characters"),
        (generate_args(seed=10**30), "seed must be between"),
        (generate_args(method="nope"), "unknown method 'nope'; visar-tiny-random's methods: ar, "),
        (generate_args(method="sjd", model="visar-tiny-var-c2i"), "does not decode this model: 'sjd'"),
        (generate_args(model=str(not_a_model)), "is not a model folder"),
        (generate_args(model="visar-tiny-t2i", class_value=None, prompt="  "), "enter a prompt"),
        (generate_args(method="spec", draft="visar-no-such-draft"), "unknown model 'visar-no-such-draft'"),
    ]
    for args, message in cases:
        with pytest.raises(gradio_client.exceptions.AppError, match=message.replace("(", r"\(")):
            client.predict(*args, api_name="/generate")
    *_, stats, status = client.predict(*generate_args("ar"), api_name="/generate")
    assert stats["method"]["forward_passes"] == 256 and status.startswith("done")


@pytest.mark.slow
def test_browser_loads_the_page_clicks_generate_and_sees_the_images(server, tmp_path):
    from chromium import Chromium, find_chromium

    if find_chromium() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium missing in CI: .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium); CI installs it")
    images = "Array.from(document.querySelectorAll('#ar-image img, #method-image img'))"
    with Chromium(width=1400, height=1100) as browser:
        browser.open(server["url"])
        browser.wait_for("!!document.querySelector('button#generate')", "the Generate button")
        assert browser.evaluate(f"{images}.length") == 0
        browser.evaluate("document.querySelector('button#generate').click()")
        browser.wait_for(f"{images}.filter(i => i.complete && i.naturalWidth >= 256).length == 2", "both images", 120)
        browser.wait_for("document.querySelector('#summary').innerText.includes('forward passes')", "the figures")
        summary = browser.evaluate("document.querySelector('#summary').innerText")
        shot = browser.screenshot(tmp_path / "demo.png")
        # a bad option value: a message in the page, and the page still works
        window = "Array.from(document.querySelectorAll('label')).find(l => l.innerText.trim().startsWith('window'))"
        browser.evaluate(
            f"(() => {{ const box = {window}.parentElement.querySelector('input, textarea');"
            "box.value = '-1'; box.dispatchEvent(new Event('input', {bubbles: true})); })()"
        )
        browser.evaluate("document.querySelector('button#generate').click()")
        browser.wait_for("document.body.innerText.includes('window must be an integer >= 1')", "the error message", 60)
        # the click cleared the last result before it failed: no image nor figure of it is left
        # (the failed event leaves Gradio's "Error" badge on its outputs, not the last run's figures)
        figures = "document.querySelector('#summary').innerText.includes('forward passes')"
        cleared = browser.evaluate(f"{images}.length == 0 && !{figures}")
    assert "256" in summary and "sjd" in summary and cleared
    picture = np.asarray(Image.open(shot).convert("RGB"))
    assert picture.shape[0] >= 1000 and picture.shape[1] == 1400
    assert picture.std() > 10  # the page drew something, not a blank screen
