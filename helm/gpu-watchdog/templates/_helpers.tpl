{{- define "gpu-watchdog.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpu-watchdog.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-watchdog.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-watchdog.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpu-watchdog.labels" -}}
{{ include "gpu-watchdog.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "gpu-watchdog.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpu-watchdog.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The watchdog config: the user's settings plus what only the chart knows. */}}
{{/* The engine serving the model: bundled, vllm or external. */}}
{{- define "gpu-watchdog.engine" -}}
{{- .Values.inference.engine | default "bundled" -}}
{{- end -}}

{{/* The port the serving container listens on. */}}
{{- define "gpu-watchdog.servingPort" -}}
{{- $engine := include "gpu-watchdog.engine" . -}}
{{- if eq $engine "vllm" -}}{{ .Values.vllm.port }}{{- else if eq $engine "external" -}}{{ .Values.external.port }}{{- else -}}8000{{- end -}}
{{- end -}}

{{/* The API-key Secret of a vllm/external server ("" when none). */}}
{{- define "gpu-watchdog.apiKeySecret" -}}
{{- $engine := include "gpu-watchdog.engine" . -}}
{{- if eq $engine "vllm" -}}{{ .Values.vllm.apiKeySecret.name }}{{- else if eq $engine "external" -}}{{ .Values.external.apiKeySecret.name }}{{- end -}}
{{- end -}}

{{/* "true" when the sidecar asks the kubelet which GPUs are the pod's. */}}
{{- define "gpu-watchdog.podResources" -}}
{{- $on := .Values.watchdog.podResources.enabled -}}
{{- if kindIs "invalid" $on -}}{{- $on = ne (include "gpu-watchdog.engine" .) "bundled" -}}{{- end -}}
{{- if $on -}}true{{- end -}}
{{- end -}}

{{- define "gpu-watchdog.watchdogConfig" -}}
{{- $cfg := deepCopy .Values.watchdog.config -}}
{{- $engine := include "gpu-watchdog.engine" . -}}
{{- if eq $engine "bundled" -}}
{{- $_ := set $cfg "target" (dict "control_url" "http://127.0.0.1:8001" "token_file" "/var/run/gpu-watchdog/token") -}}
{{- else -}}
{{- $port := include "gpu-watchdog.servingPort" . -}}
{{- $metricsPath := ternary .Values.external.metricsPath "/metrics" (eq $engine "external") -}}
{{- $target := dict "openai_url" (printf "http://127.0.0.1:%s/v1" $port) "token_file" nil -}}
{{- $_ := set $target "metrics_url" (ternary (printf "http://127.0.0.1:%s%s" $port $metricsPath) nil (ne $metricsPath "")) -}}
{{- if eq $engine "vllm" -}}{{- with .Values.vllm.servedModelName -}}{{- $_ := set $target "openai_model" . -}}{{- end -}}{{- end -}}
{{- if include "gpu-watchdog.apiKeySecret" . -}}{{- $_ := set $target "api_key_file" "/var/run/gpu-watchdog-api-key/key" -}}{{- end -}}
{{- $_ := set $cfg "target" $target -}}
{{- end -}}
{{- $kube := dict "pod_name" "${POD_NAME}" "namespace" "${POD_NAMESPACE}" "node_name" "${NODE_NAME}" -}}
{{- if include "gpu-watchdog.podResources" . -}}
{{- $_ := set $kube "pod_resources_socket" "/var/lib/kubelet/pod-resources/kubelet.sock" -}}
{{- end -}}
{{- $_ := set $cfg "kubernetes" $kube -}}
{{- $_ := set $cfg "server" (dict "host" "0.0.0.0" "port" 9402) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* An image reference; a missing repository fails the install with where to look. */}}
{{- define "gpu-watchdog.image" -}}
{{- $img := index . 0 -}}{{- $key := index . 1 -}}
{{- $msg := printf "%s.repository is not set: build and push the images first (make images; make push REGISTRY=...; README, section Kubernetes), then --set %s.repository=REGISTRY/gpu-watchdog-%s" $key $key (ternary "inference" "watchdog" (hasPrefix "inference" $key)) -}}
{{- printf "%s:%s" (required $msg $img.repository) $img.tag -}}
{{- end -}}
