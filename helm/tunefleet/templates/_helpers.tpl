{{/*
Names, labels and the environment shared by every control-plane container.
*/}}

{{- define "tunefleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tunefleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tunefleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels (Kubernetes recommended labels + Helm's chart label). */}}
{{- define "tunefleet.labels" -}}
helm.sh/chart: {{ include "tunefleet.chart" . }}
{{ include "tunefleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tunefleet
{{- end }}

{{- define "tunefleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tunefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "ctx" $ "component" "api"). */}}
{{- define "tunefleet.componentLabels" -}}
{{ include "tunefleet.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tunefleet.componentSelectorLabels" -}}
{{ include "tunefleet.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tunefleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tunefleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tunefleet.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}:{{ $tag }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end }}

{{- define "tunefleet.trainingNamespace" -}}
{{- default .Release.Namespace .Values.training.namespace }}
{{- end }}

{{- define "tunefleet.publicUrl" -}}
{{- if .Values.publicUrl }}
{{- .Values.publicUrl | trimSuffix "/" }}
{{- else }}
{{- printf "http://%s-api.%s.svc:%v" (include "tunefleet.fullname" .) .Release.Namespace .Values.api.service.port }}
{{- end }}
{{- end }}

{{/* Secret names and keys: the chart's own Secret unless an existing one is named. */}}
{{- define "tunefleet.databaseSecret" -}}
{{- default (include "tunefleet.fullname" .) .Values.database.existingSecret }}
{{- end }}
{{- define "tunefleet.databaseSecretKey" -}}
{{- if .Values.database.existingSecret }}{{ .Values.database.existingSecretKey }}{{ else }}database-url{{ end }}
{{- end }}
{{- define "tunefleet.brokerSecret" -}}
{{- default (include "tunefleet.fullname" .) .Values.broker.existingSecret }}
{{- end }}
{{- define "tunefleet.brokerSecretKey" -}}
{{- if .Values.broker.existingSecret }}{{ .Values.broker.existingSecretKey }}{{ else }}broker-url{{ end }}
{{- end }}
{{- define "tunefleet.authSecret" -}}
{{- default (include "tunefleet.fullname" .) .Values.auth.existingSecret }}
{{- end }}
{{- define "tunefleet.s3Secret" -}}
{{- if .Values.artifacts.s3.existingSecret }}
{{- .Values.artifacts.s3.existingSecret }}
{{- else if .Values.artifacts.s3.accessKeyId }}
{{- printf "%s-s3" (include "tunefleet.fullname" .) }}
{{- end }}
{{- end }}

{{/*
What trainer pods authenticate to the object store with: the Secret whose keys become
their environment (empty: none) and their ServiceAccount (empty: the namespace's default).
*/}}
{{- define "tunefleet.trainerSecret" -}}
{{- if .Values.training.credentials.existingSecret }}
{{- .Values.training.credentials.existingSecret }}
{{- else if and (not .Values.artifacts.s3.existingSecret) .Values.artifacts.s3.accessKeyId }}
{{- printf "%s-trainer-s3" (include "tunefleet.fullname" .) }}
{{- else if and .Values.artifacts.s3.existingSecret (eq (include "tunefleet.trainingNamespace" .) .Release.Namespace) }}
{{- .Values.artifacts.s3.existingSecret }}
{{- end }}
{{- end }}
{{- define "tunefleet.trainerServiceAccount" -}}
{{- if .Values.training.serviceAccount.create }}
{{- default (printf "%s-trainer" (include "tunefleet.fullname" .)) .Values.training.serviceAccount.name }}
{{- else }}
{{- .Values.training.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* kueue.priorityClasses as "high=batch-high,low=batch-low" (keys in sorted order). */}}
{{- define "tunefleet.kueuePriorityClasses" -}}
{{- $pairs := list }}
{{- range $priority, $class := .Values.kueue.priorityClasses }}
{{- $pairs = append $pairs (printf "%s=%s" $priority $class) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/*
Environment of the API, worker and scheduler containers (docs/internals.md "Settings").
*/}}
{{- define "tunefleet.env" -}}
- name: TUNEFLEET_ENV
  value: {{ .Values.environment | quote }}
- name: TUNEFLEET_EXECUTOR
  value: kubernetes
- name: TUNEFLEET_DATA_DIR
  value: /tmp/tunefleet
- name: TUNEFLEET_PUBLIC_URL
  value: {{ include "tunefleet.publicUrl" . | quote }}
- name: TUNEFLEET_ALLOW_HTTP_PUBLIC_URL
  value: {{ or (not .Values.publicUrl) .Values.allowHttpPublicUrl | quote }}
- name: TUNEFLEET_ARTIFACT_URL
  value: {{ .Values.artifacts.url | quote }}
{{- with .Values.artifacts.s3.endpointUrl }}
- name: TUNEFLEET_S3_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.artifacts.s3.region }}
- name: AWS_DEFAULT_REGION
  value: {{ . | quote }}
{{- end }}
- name: TUNEFLEET_NODE_POOLS_FILE
  value: /etc/tunefleet/pools.yaml
{{- if .Values.baseModels }}
- name: TUNEFLEET_BASE_MODELS_FILE
  value: /etc/tunefleet/base_models.yaml
{{- end }}
{{- with .Values.webhooks.allowedHosts }}
- name: TUNEFLEET_WEBHOOK_ALLOWED_HOSTS
  value: {{ join "," . | quote }}
{{- end }}
{{- with .Values.trackers.allowedHosts }}
- name: TUNEFLEET_TRACKER_ALLOWED_HOSTS
  value: {{ join "," . | quote }}
{{- end }}
{{- with .Values.hub.allowedRepos }}
- name: TUNEFLEET_HUB_ALLOWED_REPOS
  value: {{ join "," . | quote }}
{{- end }}
{{- with .Values.hub.endpoint }}
- name: HF_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: TUNEFLEET_K8S_NAMESPACE
  value: {{ include "tunefleet.trainingNamespace" . | quote }}
{{- with include "tunefleet.trainerSecret" . }}
- name: TUNEFLEET_K8S_TRAINER_SECRET
  value: {{ . | quote }}
{{- end }}
{{- with include "tunefleet.trainerServiceAccount" . }}
- name: TUNEFLEET_K8S_TRAINER_SERVICE_ACCOUNT
  value: {{ . | quote }}
{{- if $.Values.training.serviceAccount.automountToken }}
- name: TUNEFLEET_K8S_TRAINER_AUTOMOUNT_TOKEN
  value: "true"
{{- end }}
{{- end }}
{{- with .Values.training.priorityClassName }}
- name: TUNEFLEET_K8S_TRAINER_PRIORITY_CLASS
  value: {{ . | quote }}
{{- end }}
{{- if .Values.training.maxRuntimeSeconds }}
- name: TUNEFLEET_K8S_TRAINER_MAX_RUNTIME_S
  value: {{ .Values.training.maxRuntimeSeconds | int64 | quote }}
{{- end }}
{{- if .Values.kueue.enabled }}
- name: TUNEFLEET_KUEUE_QUEUE
  value: {{ .Values.kueue.localQueue | quote }}
{{- with .Values.kueue.priorityClasses }}
- name: TUNEFLEET_KUEUE_PRIORITY_CLASSES
  value: {{ include "tunefleet.kueuePriorityClasses" $ | quote }}
{{- end }}
{{- end }}
- name: TUNEFLEET_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "tunefleet.databaseSecret" . }}
      key: {{ include "tunefleet.databaseSecretKey" . }}
- name: TUNEFLEET_BROKER_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "tunefleet.brokerSecret" . }}
      key: {{ include "tunefleet.brokerSecretKey" . }}
- name: TUNEFLEET_SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tunefleet.authSecret" . }}
      key: secret-key
- name: TUNEFLEET_ADMIN_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tunefleet.authSecret" . }}
      key: admin-api-key
      optional: true
- name: TUNEFLEET_METRICS_DATABASE_GAUGES
  value: scheduler
- name: TUNEFLEET_METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tunefleet.authSecret" . }}
      key: metrics-token
      optional: true
{{- with include "tunefleet.s3Secret" . }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- end }}

{{/* The worker's and the scheduler's /metrics and /healthz: port, and probes of /healthz. */}}
{{- define "tunefleet.metricsPort" -}}
ports:
  - name: metrics
    containerPort: {{ .Values.metrics.port }}
    protocol: TCP
{{- end }}
{{- define "tunefleet.metricsProbes" -}}
startupProbe:
  httpGet:
    path: /healthz
    port: metrics
  periodSeconds: 5
  failureThreshold: 36
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 3
{{- end }}

{{/* Writable scratch space: the root filesystem is read-only. */}}
{{- define "tunefleet.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}
{{- define "tunefleet.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}
