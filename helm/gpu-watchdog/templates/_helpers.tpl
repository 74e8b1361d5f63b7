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
{{- define "gpu-watchdog.watchdogConfig" -}}
{{- $cfg := deepCopy .Values.watchdog.config -}}
{{- $_ := set $cfg "target" (dict "control_url" "http://127.0.0.1:8001" "token_file" "/var/run/gpu-watchdog/token") -}}
{{- $_ := set $cfg "kubernetes" (dict "pod_name" "${POD_NAME}" "namespace" "${POD_NAMESPACE}") -}}
{{- $_ := set $cfg "server" (dict "host" "0.0.0.0" "port" 9402) -}}
{{- toYaml $cfg -}}
{{- end -}}
