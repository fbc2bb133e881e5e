"""The daemon's two sensors: one marks runs cut off by a kill -9 or a reboot as failed, one resumes the pipeline.
What they decide lives in pipeline/resume.py (the CLI asks the same functions)."""

import dagster as dg

from gguf_assets.pipeline.resume import mark_interrupted_runs, resume_decision, sensor_interval_s


def _mark_and_report(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    marked = mark_interrupted_runs(context.instance)
    return dg.SkipReason(f"marked {len(marked)} interrupted run(s) as failed: {marked}" if marked
                         else "no interrupted runs")


def interrupted_runs_sensor(*, running: bool = True) -> dg.SensorDefinition:
    """The sensor; it runs by default when the project's output.auto_resume is true, and can be
    switched on in the UI otherwise."""
    return dg.SensorDefinition(
        name="interrupted_runs_sensor", evaluation_fn=_mark_and_report, minimum_interval_seconds=sensor_interval_s(),
        default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
        description="Marks runs cut off by a reboot or a kill -9 as failed and frees their gpu pool slots.")


def resume_sensor(*, running: bool = True) -> dg.SensorDefinition:
    """Resumes the project's pipeline by itself after a kill -9 or a reboot (with only the daemon running)."""
    from gguf_assets.defs.jobs import JOBS

    return dg.SensorDefinition(
        name="resume_pipeline_sensor", evaluation_fn=lambda context: resume_decision(context.instance),
        minimum_interval_seconds=sensor_interval_s(), jobs=JOBS,
        default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
        description="Finishes a pipeline cut off by a kill -9 or a reboot, and materializes what is missing, one "
                    "named job at a time. Work made stale by a settings edit waits for you.")
