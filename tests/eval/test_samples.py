"""`visar.eval.samples.generate_missing`, what the evaluation commands and the batch tool write images
with: in a refilling run each image is saved as soon as it is done, so an interrupted run keeps every
finished image, and a resumed one (at another batch size) writes the files of an uninterrupted run."""

import pytest
from laws import tiny_pipeline

from visar.eval.samples import SampleJob, generate_missing


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("llamagen")


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_an_interrupted_refilling_run_keeps_its_finished_images_and_resumes_to_the_same_files(pipe, tmp_path):
    def jobs(folder):
        return [SampleJob(folder / f"{i:05d}.png", i % 4, 100 + i) for i in range(7)]

    reference = tmp_path / "reference"
    generate_missing(pipe, jobs(reference), method="mc-sjd", batch_size=3, progress=False)
    interrupted = tmp_path / "interrupted"
    saved = []

    def stop_after_three(job, record):
        saved.append(job)
        if len(saved) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_missing(
            pipe, jobs(interrupted), method="mc-sjd", batch_size=3, progress=False, on_image=stop_after_three
        )
    assert len(list(interrupted.glob("*.png"))) == 3
    stats = generate_missing(pipe, jobs(interrupted), method="mc-sjd", batch_size=2, progress=False)
    assert stats["generated"] == 4 and stats["reused"] == 3
    for job in jobs(reference):
        assert (interrupted / job.path.name).read_bytes() == job.path.read_bytes()
