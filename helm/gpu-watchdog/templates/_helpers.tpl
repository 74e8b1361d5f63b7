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

{{/* How the watchdog restarts: container, evict, delete or none (watchdog.config.restart.strategy). */}}
{{- define "gpu-watchdog.restartStrategy" -}}
{{- .Values.watchdog.config.restart.strategy | default "container" -}}
{{- end -}}

{{/*
The fleet's Lease, "" when there is none: the ledger the replicas share so that at most
policy.fleet.max_unavailable of them restart at once. Only where the watchdog restarts at all and
policy.fleet.enabled is not false.
*/}}
{{- define "gpu-watchdog.fleetLease" -}}
{{- $fleet := dig "policy" "fleet" dict .Values.watchdog.config -}}
{{- $quarantine := dig "policy" "quarantine" dict .Values.watchdog.config -}}
{{- $placement := dig "policy" "placement" dict .Values.watchdog.config -}}
{{- /* The placement records (policy.placement) live in the same Lease. */ -}}
{{- $used := or (ne (toString (dig "enabled" true $fleet)) "false") (ne (toString (dig "enabled" true $quarantine)) "false") (ne (toString (dig "strategy" "off" $placement)) "off") -}}
{{- if and (ne (include "gpu-watchdog.restartStrategy" .) "none") $used -}}
{{- printf "%s-fleet" (include "gpu-watchdog.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
"true" when the watchdog runs as a native sidecar: an initContainers entry with restartPolicy Always,
which the kubelet starts before the app containers and stops after them. On by default from
Kubernetes 1.29 (SidecarContainers beta), GA in 1.33. Before 1.28 the API server does not know the
field and drops it: the watchdog would be an init container that never exits and the model server
would never start, so `true` there is refused. The "-0" lets providers' versions (v1.29.3-eks-...,
v1.30.1-gke.100) count: semver treats their suffix as a pre-release.
*/}}
{{- define "gpu-watchdog.nativeSidecar" -}}
{{- /* Not `default`: it would turn false into auto. */ -}}
{{- $mode := .Values.watchdog.nativeSidecar -}}
{{- if kindIs "invalid" $mode -}}{{- $mode = "auto" -}}{{- end -}}
{{- $mode = toString $mode -}}
{{- $kube := .Capabilities.KubeVersion.Version -}}
{{- if eq $mode "auto" -}}
{{- if semverCompare ">=1.29-0" $kube -}}true{{- end -}}
{{- else if eq $mode "true" -}}
{{- if semverCompare "<1.28-0" $kube -}}
{{- fail (printf "watchdog.nativeSidecar=true: Kubernetes %s has no restartPolicy on init containers (1.28 alpha behind the SidecarContainers gate, on by default from 1.29); the API server would drop it, leaving the watchdog an init container that never exits and the model server never started. Use auto or false" $kube) -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The PodSecurity level the release's namespace enforces (values: podSecurityLevel). */}}
{{- define "gpu-watchdog.podSecurityLevel" -}}
{{- .Values.podSecurityLevel | default "restricted" -}}
{{- end -}}

{{/*
"true" when the sidecar asks the kubelet which GPUs are the pod's. It needs a hostPath (refused by
PodSecurity baseline and restricted) and root (the kubelet's socket is root-only), so null turns it
on only where both are allowed, and true where they are not stops the install with what to change.
*/}}
{{- define "gpu-watchdog.podResources" -}}
{{- $pr := .Values.watchdog.podResources -}}
{{- $level := include "gpu-watchdog.podSecurityLevel" . -}}
{{- $possible := and (eq $level "privileged") $pr.runAsRoot -}}
{{- $on := $pr.enabled -}}
{{- if kindIs "invalid" $on -}}
{{- $on = and $possible (ne (include "gpu-watchdog.engine" .) "bundled") -}}
{{- else if and $on (ne $level "privileged") -}}
{{- fail (printf "watchdog.podResources.enabled: the kubelet's PodResources socket is a hostPath volume, which PodSecurity %q rejects (the ReplicaSet would report FailedCreate and no pod would start). Label the namespace pod-security.kubernetes.io/enforce=privileged and set podSecurityLevel=privileged, or leave watchdog.podResources.enabled null" $level) -}}
{{- else if and $on (not $pr.runAsRoot) -}}
{{- fail "watchdog.podResources.enabled: the kubelet's socket (/var/lib/kubelet/pod-resources/kubelet.sock) is owned by root and not writable by others, so a non-root sidecar cannot connect; set watchdog.podResources.runAsRoot=true, or leave watchdog.podResources.enabled null" -}}
{{- end -}}
{{- if $on -}}true{{- end -}}
{{- end -}}

{{/* Seconds from a duration as the watchdog's config writes it: 30s, 10m, 24h, 250ms, or a number. */}}
{{- define "gpu-watchdog.seconds" -}}
{{- $v := toString . | trim -}}
{{- $re := "^([0-9]+(\\.[0-9]+)?)\\s*(ms|s|m|h|d)?$" -}}
{{- if not (regexMatch $re $v) -}}{{- fail (printf "not a duration: %q (expected 30s, 10m, 24h or a number of seconds)" $v) -}}{{- end -}}
{{- $n := regexReplaceAll $re $v "${1}" | float64 -}}
{{- $unit := regexReplaceAll $re $v "${3}" | default "s" -}}
{{- $factor := get (dict "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 "d" 86400.0) $unit -}}
{{- mulf $n $factor -}}
{{- end -}}

{{/* The inference container's startup probe failures: enough to outlast policy.startup_timeout. */}}
{{- define "gpu-watchdog.startupFailureThreshold" -}}
{{- $probe := .Values.inference.startupProbe -}}
{{- $period := $probe.periodSeconds | default 5 -}}
{{- $timeout := include "gpu-watchdog.seconds" (dig "policy" "startup_timeout" "30m" .Values.watchdog.config) | float64 -}}
{{- /* A minute beyond the watchdog's own limit: its restart (with an Event naming startup_timeout) comes first. */ -}}
{{- $needed := ceil (divf (addf $timeout 60.0) $period) | int -}}
{{- if kindIs "invalid" $probe.failureThreshold -}}
{{- $needed -}}
{{- else if lt (mulf $probe.failureThreshold $period) $timeout -}}
{{- fail (printf "inference.startupProbe: %v failures x %vs is %vs, shorter than watchdog.config.policy.startup_timeout (%vs): the kubelet would kill a model still loading before the watchdog's limit. Leave failureThreshold null (it is derived) or raise it to at least %d" $probe.failureThreshold $period (mul $probe.failureThreshold $period) $timeout $needed) -}}
{{- else -}}
{{- $probe.failureThreshold -}}
{{- end -}}
{{- end -}}

{{- /* The bundled server's worker processes: one per GPU, checked against inference.gpus. */ -}}
{{- define "gpu-watchdog.workers" -}}
{{- $gpus := int .Values.inference.gpus -}}
{{- $w := .Values.inference.workers -}}
{{- if kindIs "invalid" $w -}}{{- $w = "auto" -}}{{- end -}}
{{- $engine := include "gpu-watchdog.engine" . -}}
{{- if eq (toString $w) "auto" -}}
{{- ternary $gpus 1 (and (eq $engine "bundled") (gt $gpus 1)) -}}
{{- else -}}
{{- $n := int $w -}}
{{- if and (gt $n 1) (ne $engine "bundled") -}}
{{- fail (printf "inference.workers=%d: worker processes are the bundled server's (inference.engine %s runs its own); leave it auto" $n $engine) -}}
{{- else if and (gt $gpus 0) (gt $n $gpus) -}}
{{- fail (printf "inference.workers=%d is more than inference.gpus=%d: one worker per GPU, never two on one card (each measures its budget as if the card were its own)" $n $gpus) -}}
{{- else if and (gt $n 1) (lt $n $gpus) -}}
{{- fail (printf "inference.workers=%d with inference.gpus=%d would leave %d GPU(s) without a worker: set inference.workers to %d (one per GPU), or to 1 for one process that uses them all" $n $gpus (sub $gpus $n) $gpus) -}}
{{- end -}}
{{- $n -}}
{{- end -}}
{{- end -}}

{{/*
Bytes from a size: (list VALUE "quantity") reads a Kubernetes quantity (128Mi, 1Gi, 500M),
(list VALUE "config") a size as the sidecar's config writes it (64MiB, 1GB, or a number of bytes).
*/}}
{{- define "gpu-watchdog.bytes" -}}
{{- $value := index . 0 -}}{{- $kind := index . 1 -}}
{{- if or (kindIs "float64" $value) (kindIs "int" $value) (kindIs "int64" $value) -}}
{{- float64 $value -}}
{{- else -}}
{{- $v := toString $value | trim -}}
{{- $re := "^([0-9]+(\\.[0-9]+)?)\\s*([A-Za-z]*)$" -}}
{{- $units := dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 -}}
{{- if eq $kind "config" -}}
{{- $units = dict "" 1.0 "b" 1.0 "kib" 1024.0 "mib" 1048576.0 "gib" 1073741824.0 "tib" 1099511627776.0 "kb" 1e3 "mb" 1e6 "gb" 1e9 "tb" 1e12 -}}
{{- end -}}
{{- $unit := regexReplaceAll $re $v "${3}" -}}
{{- if eq $kind "config" -}}{{- $unit = lower $unit -}}{{- end -}}
{{- if or (not (regexMatch $re $v)) (not (hasKey $units $unit)) -}}
{{- fail (printf "not a size: %q (expected %s)" $v (ternary "64MiB, 1GiB or a number of bytes" "128Mi, 1Gi or a number of bytes" (eq $kind "config"))) -}}
{{- end -}}
{{- mulf (regexReplaceAll $re $v "${1}" | float64) (get $units $unit) -}}
{{- end -}}
{{- end -}}

{{/*
"true" when the flight recorder is on (watchdog.recorder.enabled): the sidecar appends every input
its core sees to /var/lib/gpu-watchdog/flight.jsonl, on an emptyDir the watchdog container alone
mounts. The recording and its rotated .1 together stay within watchdog.config.recorder.max_bytes,
which must fit under the emptyDir's sizeLimit: the kubelet evicts a pod whose emptyDir outgrows it.
*/}}
{{- define "gpu-watchdog.recorder" -}}
{{- $rec := .Values.watchdog.recorder | default dict -}}
{{- if $rec.enabled -}}
{{- $max := dig "recorder" "max_bytes" "64MiB" .Values.watchdog.config -}}
{{- $limit := $rec.sizeLimit | default "128Mi" -}}
{{- if le (include "gpu-watchdog.bytes" (list $limit "quantity") | float64) (include "gpu-watchdog.bytes" (list $max "config") | float64) -}}
{{- $said := ternary (toString $max) (printf "%d" (int64 $max)) (kindIs "string" $max) -}}
{{- fail (printf "watchdog.recorder.sizeLimit=%v is not above watchdog.config.recorder.max_bytes=%s: the recording and its rotated .1 together fill up to max_bytes, and the kubelet evicts a pod whose emptyDir outgrows its sizeLimit; raise watchdog.recorder.sizeLimit or lower watchdog.config.recorder.max_bytes" $limit $said) -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* Where the sidecar writes its flight recording when watchdog.recorder.enabled. */}}
{{- define "gpu-watchdog.recorderDir" -}}/var/lib/gpu-watchdog{{- end -}}

{{- define "gpu-watchdog.watchdogConfig" -}}
{{- $cfg := deepCopy .Values.watchdog.config -}}
{{- $engine := include "gpu-watchdog.engine" . -}}
{{- /* Keys the chart owns win; the rest of the user's target and kubernetes sections stays. */ -}}
{{- $userTarget := deepCopy ($cfg.target | default dict) -}}
{{- $userKube := deepCopy ($cfg.kubernetes | default dict) -}}
{{- if eq $engine "bundled" -}}
{{- $_ := set $cfg "target" (merge (dict "control_url" "http://127.0.0.1:8001" "token_file" "/var/run/gpu-watchdog/token" "workers" (int (include "gpu-watchdog.workers" .))) $userTarget) -}}
{{- else -}}
{{- $port := include "gpu-watchdog.servingPort" . -}}
{{- $metricsPath := ternary .Values.external.metricsPath "/metrics" (eq $engine "external") -}}
{{- $target := dict "openai_url" (printf "http://127.0.0.1:%s/v1" $port) "token_file" nil -}}
{{- if eq $engine "external" -}}
{{- /* Not OpenAI-compatible: the canary is the request given in external.http. */ -}}
{{- with .Values.external.http -}}{{- $target = dict "http" (deepCopy .) "token_file" nil -}}{{- end -}}
{{- with .Values.external.progressMetric -}}{{- $_ := set $target "progress_metric" . -}}{{- end -}}
{{- end -}}
{{- $_ := set $target "metrics_url" (ternary (printf "http://127.0.0.1:%s%s" $port $metricsPath) nil (ne $metricsPath "")) -}}
{{- if eq $engine "vllm" -}}{{- with .Values.vllm.servedModelName -}}{{- $_ := set $target "openai_model" . -}}{{- end -}}{{- end -}}
{{- if include "gpu-watchdog.apiKeySecret" . -}}{{- $_ := set $target "api_key_file" "/var/run/gpu-watchdog-api-key/key" -}}{{- end -}}
{{- $_ := set $cfg "target" (merge $target $userTarget) -}}
{{- end -}}
{{- $kube := dict "pod_name" "${POD_NAME}" "namespace" "${POD_NAMESPACE}" "node_name" "${NODE_NAME}" -}}
{{- if include "gpu-watchdog.podResources" . -}}
{{- $_ := set $kube "pod_resources_socket" "/var/lib/kubelet/pod-resources/kubelet.sock" -}}
{{- end -}}
{{- $_ := set $cfg "kubernetes" (merge $kube $userKube) -}}
{{- $_ := set $cfg "server" (dict "host" "0.0.0.0" "port" 9402) -}}
{{- /* Without the Role for Events in `default`, the sidecar must not try to write its Node Event. */ -}}
{{- $policy := deepCopy ($cfg.policy | default dict) -}}
{{- $escalation := deepCopy ($policy.escalation | default dict) -}}
{{- $_ := set $escalation "node_event" (.Values.watchdog.nodeEvents | default false) -}}
{{- $_ := set $policy "escalation" $escalation -}}
{{- /* The chart creates the fleet's Lease and its Role may touch that one alone (resourceNames). */ -}}
{{- with include "gpu-watchdog.fleetLease" . -}}
{{- $fleet := deepCopy ($policy.fleet | default dict) -}}
{{- $own := toString ($fleet.lease_name | default "") -}}
{{- if and $own (ne $own .) -}}
{{- fail (printf "watchdog.config.policy.fleet.lease_name=%q: the chart creates the fleet's Lease as %q and lets the sidecar get and update that one only; leave lease_name unset" $own .) -}}
{{- end -}}
{{- $_ := set $fleet "lease_name" . -}}
{{- $_ := set $policy "fleet" $fleet -}}
{{- end -}}
{{- $_ := set $cfg "policy" $policy -}}
{{- /* The flight recording goes to the recorder's emptyDir, or nowhere; max_bytes stays the user's. */ -}}
{{- $recorder := deepCopy ($cfg.recorder | default dict) -}}
{{- $_ := set $recorder "path" (ternary (printf "%s/flight.jsonl" (include "gpu-watchdog.recorderDir" .)) nil (eq (include "gpu-watchdog.recorder" .) "true")) -}}
{{- $_ := set $cfg "recorder" $recorder -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* An image reference; a missing repository fails the install with where to look. */}}
{{- define "gpu-watchdog.image" -}}
{{- $img := index . 0 -}}{{- $key := index . 1 -}}
{{- $msg := printf "%s.repository is not set: build and push the images first (make images; make push REGISTRY=...; README, On Kubernetes: docs/kubernetes.md), then --set %s.repository=REGISTRY/gpu-watchdog-%s" $key $key (ternary "inference" "watchdog" (hasPrefix "inference" $key)) -}}
{{- printf "%s:%s" (required $msg $img.repository) $img.tag -}}
{{- end -}}

{{/* Labels of a Prometheus Operator object; refuses one that no Prometheus would select. */}}
{{- define "gpu-watchdog.monitoringLabels" -}}
{{- $root := index . 0 -}}{{- $key := index . 1 -}}
{{- $extra := deepCopy ((index $root.Values $key).labels | default dict) -}}
{{- with $root.Values.prometheusRelease -}}{{- $_ := set $extra "release" . -}}{{- end -}}
{{- if not $extra -}}
{{- fail (printf "%s.enabled: kube-prometheus-stack's Prometheus selects %s objects by the label release=<its Helm release name>; set prometheusRelease to that name (or %s.labels to what your Prometheus selects), otherwise nothing is scraped" $key (ternary "ServiceMonitor" "PrometheusRule" (eq $key "serviceMonitor")) $key) -}}
{{- end -}}
{{ include "gpu-watchdog.labels" $root }}
{{ toYaml $extra }}
{{- end -}}

{{/*
The request fingerprint key's Secret (the query of death): one per release, so every replica
fingerprints a request alike and nobody without it can compute one. Created once and kept: an
upgrade reads the key back (lookup) rather than drawing a new one, which would make the
quarantined fingerprints stale.
*/}}
{{- define "gpu-watchdog.fingerprintSecret" -}}
{{- .Values.inference.fingerprintKeySecret | default (printf "%s-fingerprint" (include "gpu-watchdog.fullname" .) | trunc 63 | trimSuffix "-") -}}
{{- end -}}

{{- define "gpu-watchdog.fingerprintEnv" -}}
- name: GPU_WATCHDOG_FINGERPRINT_KEY
  valueFrom: {secretKeyRef: {name: {{ include "gpu-watchdog.fingerprintSecret" . }}, key: key}}
{{- end -}}
