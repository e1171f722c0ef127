{{/* Names: <release>-lorafaas-<component>, cut to 63 characters. */}}
{{- define "lorafaas.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "lorafaas.name" -}}
{{- printf "%s-%s" (include "lorafaas.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every object carries; selectorLabels are the immutable subset used by selectors. */}}
{{- define "lorafaas.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "lorafaas.labels" -}}
{{ include "lorafaas.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* An image reference, registry/repository:tag[-cuda][@digest]: {{ include "lorafaas.image" (dict "root" .
"image" .Values.image.gateway) }}. Each image has its own digest (three builds, three digests); the tag is kept before
it for people reading the pod (the runtime pulls by the digest). */}}
{{- define "lorafaas.image" -}}
{{- $values := .root.Values.image -}}
{{- $tag := default .root.Chart.AppVersion $values.tag -}}
{{- if eq $values.variant "cuda" }}{{ $tag = printf "%s-cuda" $tag }}{{ end -}}
{{- $repository := .image.repository -}}
{{- if $values.registry }}{{ $repository = printf "%s/%s" $values.registry $repository }}{{ end -}}
{{- printf "%s:%s" $repository $tag -}}
{{- with .image.digest }}{{ printf "@%s" . }}{{ end -}}
{{- end -}}

{{- define "lorafaas.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "lorafaas.name" (dict "root" . "component" "controller")) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "lorafaas.adminKeySecret" -}}
{{- default (include "lorafaas.name" (dict "root" . "component" "admin-key")) .Values.adminKey.existingSecret -}}
{{- end -}}

{{- define "lorafaas.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:6379/0" (include "lorafaas.name" (dict "root" . "component" "redis")) -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{- define "lorafaas.isCuda" -}}
{{- if eq .Values.device "cuda" }}true{{ end -}}
{{- end -}}

{{/* The devices the controller schedules on: cpu, or cuda:0 ... cuda:<gpu.perNode - 1> (a daemon each). */}}
{{- define "lorafaas.devices" -}}
{{- if include "lorafaas.isCuda" . -}}
{{- range $index := until (int .Values.gpu.perNode) }}{{ if $index }},{{ end }}cuda:{{ $index }}{{ end -}}
{{- else -}}
cpu
{{- end -}}
{{- end -}}

{{/* The home: a ReadWriteMany claim, or a node directory. */}}
{{- define "lorafaas.homeVolume" -}}
- name: home
{{- if .Values.home.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.home.existingClaim }}
{{- else }}
  hostPath:
    path: {{ .Values.home.hostPath }}
    type: DirectoryOrCreate
{{- end }}
{{- end -}}

{{/* Pod-level hardening (Pod Security "restricted" where the volumes allow it): a non-root uid, the runtime's
seccomp profile. */}}
{{- define "lorafaas.podSecurityContext" -}}
runAsUser: {{ .root.Values.securityContext.runAsUser }}
runAsGroup: {{ .root.Values.securityContext.runAsGroup }}
runAsNonRoot: true
{{- if .fsGroup }}
fsGroup: {{ .root.Values.securityContext.runAsGroup }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container-level hardening: no privilege escalation, no capabilities, a read-only root filesystem (/tmp is an
emptyDir where a process needs to write). */}}
{{- define "lorafaas.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The daemons' node-local socket directory (home.runHostPath), when the home is shared by several nodes. */}}
{{- define "lorafaas.runVolume" -}}
- name: run
  hostPath:
    path: {{ .Values.home.runHostPath }}
    type: DirectoryOrCreate
{{- end -}}

{{- define "lorafaas.runMount" -}}
- name: run
  mountPath: {{ .Values.home.mountPath }}/run
{{- end -}}

{{- define "lorafaas.agentMounts" -}}
- name: home
  mountPath: {{ .Values.home.mountPath }}
{{- if .Values.home.runHostPath }}
{{ include "lorafaas.runMount" . }}
{{- end }}
- name: tmp
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
{{- end -}}

{{- /* Resource requests and limits (a dict of requests/limits) with every quantity a quoted string: Kubernetes
quantities are strings, and the Python client's models refuse a number (`cpu: 2`) when the controller reads its pod
template. A number from the values is written by toJson, which keeps a float64 out of exponent notation. */ -}}
{{- define "lorafaas.resources" -}}
{{- range $kind, $quantities := . }}
{{ $kind }}:
{{- range $name, $quantity := $quantities }}
  {{ $name }}: {{ include "lorafaas.quantity" $quantity }}
{{- else }} {}
{{- end }}
{{- else }}
{}
{{- end }}
{{- end }}

{{- /* One quantity (a string or a number from the values) as a quoted string. */ -}}
{{- define "lorafaas.quantity" -}}
{{- ternary . (toJson .) (kindIs "string" .) | quote }}
{{- end }}
