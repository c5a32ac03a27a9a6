"""`tandem k8s render`: the stack definition as Kubernetes manifests (`launch.k8s`);
`tandem k8s secrets`: the Secrets they name, made afresh into a file of their own
(`launch.k8s_secrets`). docs/kubernetes.md says how to run them on a cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.options import print_rendered

app = typer.Typer(help="Kubernetes: the stack definition as manifests, and their Secrets.", no_args_is_help=True)

KubeNamespace = Annotated[str, typer.Option(help="The Kubernetes namespace the stack runs in.")]


@app.command("render")
def render(
    stack: Annotated[str, typer.Option(help="Stack definition (TOML); default: the packaged local stack.")] = "",
    output: Annotated[str, typer.Option("--output", "-o", help="Write here instead of stdout.")] = "",
    image: Annotated[str, typer.Option(help="The Tandem image (compose/Dockerfile, target tandem).")] = "tandem:latest",
    worker_image: Annotated[str, typer.Option(
        help="The workers' image; default: --image (vLLM: a vllm-gpu or vllm-cpu build).")] = "",
    nats_image: Annotated[str, typer.Option(help="An image with nats-server.")] = "nats:2.10-alpine",
    engine: Annotated[str, typer.Option(help="Engine of every worker (sim | vllm); default: the definition's.")] = "",
    kube_namespace: KubeNamespace = "tandem",
    gpus_per_worker: Annotated[int, typer.Option(help="nvidia.com/gpu requested by each worker pod.")] = 0,
    nats_storage: Annotated[str, typer.Option(help="JetStream's volume size.")] = "1Gi",
    model_storage: Annotated[str, typer.Option(help="The model volume's size (a definition with model_dir).")] = "50Gi",
    otlp_endpoint: Annotated[str, typer.Option(help="OTLP/HTTP traces endpoint; default: no tracing.")] = "",
) -> None:
    """Print the Kubernetes manifests of a stack definition (no Secret in them)."""
    from launch.k8s import K8sOptions, render_k8s

    options = K8sOptions(image=image, worker_image=worker_image, nats_image=nats_image, engine=engine,
                         kube_namespace=kube_namespace, gpus_per_worker=gpus_per_worker, nats_storage=nats_storage,
                         model_storage=model_storage, otlp_endpoint=otlp_endpoint)
    print_rendered(stack, output, lambda definition: render_k8s(definition, options))


@app.command("secrets")
def secrets(
    output: Annotated[str, typer.Option("--output", "-o", help="The Secrets' file (made 0600; never replaced).")],
    stack: Annotated[str, typer.Option(help="Stack definition (TOML); default: the packaged local stack.")] = "",
    kube_namespace: KubeNamespace = "tandem",
) -> None:
    """Make the stack's Secrets (NATS users, TLS, API key) in a new file, to apply once.

    Prints the file's path, never a secret; refuses to replace an existing file."""
    from launch.compose_yaml import to_yaml
    from launch.definition import DefinitionError, default_definition_path, load_definition
    from launch.k8s import K8sOptions, nats_deployment
    from launch.k8s_secrets import make_secret_documents, write_secrets_file

    try:
        definition = load_definition(stack or default_definition_path())
    except DefinitionError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None
    if Path(output).exists():
        typer.secho(f"error: {output} exists: remove it first to make new secrets", fg="red", err=True)
        raise typer.Exit(2)
    nats = nats_deployment(definition, K8sOptions(kube_namespace=kube_namespace))
    documents = make_secret_documents(namespace=definition.namespace, kube_namespace=kube_namespace,
                                      instance=definition.name, nats_service=nats.name)
    path = write_secrets_file(output, "---\n".join(to_yaml(document) for document in documents))
    typer.echo(f"Secrets: {path} (0600; `kubectl apply -f {path}`, then keep or delete the file)")
