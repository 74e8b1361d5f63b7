{{/*
The watchdog container, defined once for both places it runs (gpu-watchdog.nativeSidecar): a native
sidecar (an initContainers entry; the only difference is restartPolicy Always) or the pod's second
container. Probes, mounts, securityContext and env are the same text in both.
*/}}
{{- define "gpu-watchdog.watchdogContainer" -}}
{{- $strategy := include "gpu-watchdog.restartStrategy" . -}}
{{- $engine := include "gpu-watchdog.engine" . -}}
{{- $apiKey := include "gpu-watchdog.apiKeySecret" . -}}
{{- $podResources := include "gpu-watchdog.podResources" . -}}
- name: watchdog
  {{- if include "gpu-watchdog.nativeSidecar" . }}
  restartPolicy: Always
  {{- end }}
  image: {{ include "gpu-watchdog.image" (list .Values.watchdog.image "watchdog.image") | quote }}
  imagePullPolicy: {{ .Values.watchdog.image.pullPolicy }}
  args: [run, --config=/etc/gpu-watchdog/config.yaml]
  env:
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: POD_NAMESPACE
      valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
    - name: NODE_NAME
      valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
    # The restart budget is the Deployment's, shared by every generation of its pods: the
    # sidecar reads its pod's controller at start (ownerReferences; the Role's `get pods`).
    {{- if .Values.watchdog.nvidiaVisibleDevices }}
    - name: NVIDIA_VISIBLE_DEVICES
      value: {{ .Values.watchdog.nvidiaVisibleDevices | quote }}
    {{- end }}
  ports:
    - {name: metrics, containerPort: 9402, protocol: TCP}
  # Up means serving /healthz (its loop ticks), not /readyz: readiness needs a canary answered by a
  # model server that, behind a native sidecar, starts only once this probe has passed. Plain, it
  # only holds off the two probes below.
  startupProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: 1
    timeoutSeconds: 1
    failureThreshold: 60
  # The pod leaves the Service when the last canary says the model cannot serve (a native
  # sidecar's readiness counts for the pod's, as a container's does).
  readinessProbe:
    httpGet: {path: /readyz, port: metrics}
    periodSeconds: 5
    timeoutSeconds: 2
    failureThreshold: 1
  # Restarts the watchdog alone, never the model server, in either place.
  livenessProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: 10
    timeoutSeconds: 2
    failureThreshold: 3
  resources:
    {{- toYaml .Values.watchdog.resources | nindent 4 }}
  {{- if and $podResources .Values.watchdog.podResources.runAsRoot }}
  {{- $root := deepCopy .Values.securityContext }}
  {{- $_ := set $root "runAsUser" 0 }}
  {{- $_ := set $root "runAsNonRoot" false }}
  securityContext:
    {{- toYaml $root | nindent 4 }}
  {{- else }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  {{- end }}
  volumeMounts:
    - {name: config, mountPath: /etc/gpu-watchdog, readOnly: true}
    {{- if eq $engine "bundled" }}
    - {name: control-token, mountPath: /var/run/gpu-watchdog, readOnly: true}
    {{- end }}
    {{- if $apiKey }}
    - {name: api-key, mountPath: /var/run/gpu-watchdog-api-key, readOnly: true}
    {{- end }}
    {{- if $podResources }}
    - {name: pod-resources, mountPath: /var/lib/kubelet/pod-resources, readOnly: true}
    {{- end }}
    - {name: kube-api-access, mountPath: /var/run/secrets/kubernetes.io/serviceaccount, readOnly: true}
    {{- if eq $strategy "container" }}
    - {name: verdict, mountPath: /var/run/gpu-watchdog-verdict}
    {{- end }}
    {{- if include "gpu-watchdog.recorder" . }}
    # The flight recording (watchdog.recorder): the one place this container writes to disk.
    - {name: recorder, mountPath: {{ include "gpu-watchdog.recorderDir" . }}}
    {{- end }}
{{- end -}}
