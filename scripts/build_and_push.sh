#!/usr/bin/env bash
# Build the serving image (Dockerfile) and push it to Amazon ECR, creating the repository if
# it does not exist. Prints the image URI to give `python -m deploy create --image`.
#
#   scripts/build_and_push.sh [--repository NAME] [--tag TAG] [--region REGION]
#                             [--torch-index URL] [--platform linux/amd64]
#
# Needs docker (with a running engine) and the AWS CLI v2 with credentials allowed to use ECR
# (ecr:GetAuthorizationToken, ecr:DescribeRepositories, ecr:CreateRepository, and the image
# push actions) and sts:GetCallerIdentity.
set -euo pipefail

repository=stateful-llava
tag=$(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo latest)
region=${AWS_REGION:-${AWS_DEFAULT_REGION:-}}
torch_index=
platform=linux/amd64  # SageMaker's GPU instances are x86_64

usage() {
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
}

fail() {
    echo "build_and_push: $*" >&2
    exit 1
}

while [ $# -gt 0 ]; do
    case "$1" in
        --repository) repository=${2:?--repository needs a name}; shift 2 ;;
        --tag) tag=${2:?--tag needs a value}; shift 2 ;;
        --region) region=${2:?--region needs a value}; shift 2 ;;
        --torch-index) torch_index=${2:?--torch-index needs a URL}; shift 2 ;;
        --platform) platform=${2:?--platform needs a value}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; fail "unknown argument: $1" ;;
    esac
done

command -v docker >/dev/null || fail "docker not found: install Docker and start its engine"
command -v aws >/dev/null || fail "aws not found: install the AWS CLI v2"
docker info >/dev/null 2>&1 || fail "the docker engine is not running (docker info fails)"
[ -n "$region" ] || fail "no region: pass --region or set AWS_REGION"
account=$(aws sts get-caller-identity --query Account --output text) \
    || fail "no AWS credentials (aws sts get-caller-identity failed): run aws configure or set AWS_PROFILE"

registry="$account.dkr.ecr.$region.amazonaws.com"
image="$registry/$repository:$tag"

if ! aws ecr describe-repositories --region "$region" --repository-names "$repository" >/dev/null 2>&1; then
    echo "creating ECR repository $repository in $region"
    aws ecr create-repository --region "$region" --repository-name "$repository" \
        --image-scanning-configuration scanOnPush=true >/dev/null \
        || fail "cannot create ECR repository $repository (missing ecr:CreateRepository?)"
fi

aws ecr get-login-password --region "$region" \
    | docker login --username AWS --password-stdin "$registry" \
    || fail "docker login to $registry failed"

build_args=()
[ -z "$torch_index" ] || build_args+=(--build-arg "TORCH_INDEX=$torch_index")
docker build --platform "$platform" ${build_args[@]+"${build_args[@]}"} -t "$image" "$(dirname "$0")/.." \
    || fail "docker build failed (see above)"
docker push "$image" || fail "docker push of $image failed"

echo "pushed $image"
echo "deploy it with: python -m deploy create --image $image --model-data s3://BUCKET/PREFIX/ ..."
