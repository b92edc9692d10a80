{{/* Chart name, truncated to leave room for suffixes. */}}
{{- define "switchyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name prefix of every object. */}}
{{- define "switchyard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "switchyard.operator.name" -}}{{ include "switchyard.fullname" . }}-operator{{- end -}}
{{- define "switchyard.agent.name" -}}{{ include "switchyard.fullname" . }}-agent{{- end -}}

{{/* Labels on every object (with switchyard.selectorLabels, which adds the instance). */}}
{{- define "switchyard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: switchyard
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of a component: pass (dict "ctx" $ "component" "operator"). */}}
{{- define "switchyard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "switchyard.name" .ctx }}-{{ .component }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "switchyard.componentLabels" -}}
{{ include "switchyard.labels" .ctx }}
{{ include "switchyard.selectorLabels" . }}
{{- end -}}

{{/* Image reference: pass (dict "ctx" $ "image" .Values.operator.image). */}}
{{- define "switchyard.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .ctx.Values.image.tag -}}
{{- if .ctx.Values.image.registry -}}
{{- printf "%s/%s:%s" .ctx.Values.image.registry .image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Full user name of the agent's service account, as the API server sees it. */}}
{{- define "switchyard.agent.username" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "switchyard.agent.name" . }}
{{- end -}}

{{/* Env entries pointing a component at apiServer.host:port (none when host is empty). */}}
{{- define "switchyard.apiServerEnv" -}}
{{- with .Values.apiServer.host -}}
# The control-plane endpoint instead of the kubernetes Service (apiServer.host, apiServer.port).
- name: SWITCHYARD_APISERVER_HOST
  value: {{ . | quote }}
- name: SWITCHYARD_APISERVER_PORT
  value: {{ $.Values.apiServer.port | default 6443 | int | quote }}
{{- end }}
{{- end -}}
